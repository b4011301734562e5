//! Placing a request by its conversation (docs in README, "Placing a conversation"), so
//! that the providers' prefix caches stay warm, agreed by every Edge of a cluster with
//! nothing shared between them, and never at the cost of balance:
//!
//! - **What a request says** ([`Placement`], computed once at submit, tokenizer-free):
//!   its session key when it names one (a header or a body field the shell read), else
//!   its *anchor*: the start of its prompt up to the end of its first user message (at
//!   most [`Affinity::anchor_bytes`] of that message), which every turn of a
//!   conversation repeats unchanged and which a prefix shared at the start of a first
//!   message covers; and a fingerprint of its prompt, chained hashes of 64-byte blocks
//!   (every fourth kept).
//! - **Rendezvous order.** Candidates are ranked by a hash of the key (session, else
//!   anchor) and the provider's name (node and adapter, the same on every Edge), so every
//!   Edge ranks them alike without talking to the others.
//! - **Prefix match.** Each Edge remembers which provider it sent which fingerprints to
//!   ([`PrefixIndex`], bounded); a provider whose remembered prefix of the request reaches
//!   past its anchor (a conversation that went on on this Edge, a shared prefix longer
//!   than the anchor) goes first, longest match first, rendezvous order on ties.
//! - **Bounded load.** The first provider in that order whose load (requests in flight
//!   there, from this Edge and as its node reports from others, and waiting for it)
//!   stays within `load_factor` times the group's mean, counting this request, takes it
//!   (consistent hashing with bounded loads): at once when it has room, else the request
//!   waits for it, at most [`Affinity::wait`], then for any provider. With none within
//!   the bound, the least loaded by the usual pick.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};

use foldhash::fast::FixedState;

use crate::lease::ResourceId;

pub use crate::edge_config::{Affinity, AffinityMode};

/// Request headers that name a caller's session, in the order they are read (after
/// `routing.session_header`): Claude Code's, and Codex's (both spellings).
pub const SESSION_HEADERS: [&str; 3] = ["x-claude-code-session-id", "session_id", "session-id"];

/// The longest session key used; a longer one is not a key (hashed as it is otherwise).
pub const MAX_SESSION_KEY: usize = 256;

/// Bytes per block of a prompt's fingerprint (matched blocks count these).
pub(super) const BLOCK: usize = 64;
/// One block's chained hash in this many is kept.
const STRIDE: usize = 4;
/// Most blocks of a prompt read (256 KiB).
const MAX_BLOCKS: usize = 4096;

/// Why a request went where it went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// By its session key.
    Session,
    /// By a remembered prefix reaching past its anchor.
    Prefix,
    /// By its anchor.
    Anchor,
    /// Every provider of its order was over the load bound or full: the least loaded.
    Balance,
}

impl Placed {
    /// Its metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Placed::Session => "session",
            Placed::Prefix => "prefix",
            Placed::Anchor => "anchor",
            Placed::Balance => "balance",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// What a request says of its conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The rendezvous key: the session key's hash, or the anchor's.
    key: u64,
    /// It came from a session key.
    keyed: bool,
    /// The prompt's fingerprint: the chained hash of every [`STRIDE`]th block.
    chain: Box<[u64]>,
    /// Entries of `chain` the anchor covers.
    anchor: usize,
}

/// The fixed hasher of keys and fingerprints: the same on every Edge.
fn fixed(seed: u64) -> FixedState {
    FixedState::with_seed(seed)
}

impl Placement {
    /// What `body` (a chat completion or completion request for `model`) says of its
    /// conversation, with `session` the key the caller named, if any; `None` when
    /// `mode` places by load, or places by session and there is none.
    #[must_use]
    pub fn of(
        mode: AffinityMode,
        model: &str,
        session: Option<&str>,
        body: &[u8],
        anchor_bytes: usize,
    ) -> Option<Placement> {
        let seed = fixed(0x10_9e_37).hash_one(model);
        let chain = || -> (Box<[u64]>, usize, u64) {
            let prompt = prompt(body);
            let anchor = anchor_end(prompt, anchor_bytes);
            let hasher = fixed(seed);
            let mut chain = Vec::with_capacity((prompt.len() / BLOCK).min(MAX_BLOCKS) / STRIDE);
            let mut h = seed;
            for (i, block) in prompt.chunks_exact(BLOCK).take(MAX_BLOCKS).enumerate() {
                h = hasher.hash_one((h, block));
                if (i + 1) % STRIDE == 0 {
                    chain.push(h);
                }
            }
            let key = hasher.hash_one(&prompt[..anchor]);
            (chain.into(), anchor / (BLOCK * STRIDE), key)
        };
        match (mode, session) {
            (AffinityMode::Off, _) | (AffinityMode::Session, None) => None,
            (AffinityMode::Session, Some(session)) => Some(Placement {
                key: fixed(seed).hash_one(session),
                keyed: true,
                chain: Box::new([]),
                anchor: 0,
            }),
            (AffinityMode::Prefix, session) => {
                let (chain, anchor, key) = chain();
                Some(match session {
                    Some(session) => Placement {
                        key: fixed(seed).hash_one(session),
                        keyed: true,
                        chain,
                        anchor,
                    },
                    None => Placement {
                        key,
                        keyed: false,
                        chain,
                        anchor,
                    },
                })
            }
        }
    }

    /// Whether it came from a session key.
    #[must_use]
    pub fn keyed(&self) -> bool {
        self.keyed
    }

    /// The rendezvous rank of the provider named `name` (`node/adapter`) for it: higher
    /// goes first.
    #[must_use]
    pub fn rank(&self, name: (&str, &str)) -> u64 {
        fixed(self.key).hash_one(name)
    }

    /// Blocks of its prompt the fingerprint spans.
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.chain.len() * STRIDE
    }

    /// Blocks its anchor spans (rounded down to a kept block).
    #[must_use]
    pub fn anchor_blocks(&self) -> usize {
        self.anchor * STRIDE
    }
}

/// Where the prompt starts in `body`: at its `messages` (chat) or `prompt` (completions)
/// value, or the whole body. The members before it (a model name, settings) are the
/// same for every turn of a conversation or not part of the prompt.
fn prompt(body: &[u8]) -> &[u8] {
    ["messages", "prompt"]
        .iter()
        .find_map(|key| iop_json::member_start(body, key))
        .map_or(body, |start| &body[start..])
}

/// Where the anchor of `prompt` (a `messages` value and what follows it) ends: after the
/// text of its first user message, at most `max` bytes into that text; what comes before
/// it, system prompts, is all in ([`iop_json::first_user_message`]). A prompt that is
/// not an array of messages (a completion's `prompt`) is anchored at `max`, and so is a
/// first user message whose content is not a string (at `max` bytes after its start).
fn anchor_end(prompt: &[u8], max: usize) -> usize {
    match iop_json::first_user_message(prompt) {
        None => prompt.len().min(max),
        Some((_, Some(text))) => text
            .end
            .min(text.start.saturating_add(1).saturating_add(max)),
        Some((start, None)) => prompt.len().min(start.saturating_add(max)),
    }
}

/// Which provider this Edge sent which prompt fingerprints to: a bounded set of
/// `(fingerprint, provider)` entries in two generations (the newest half and the one
/// before), so the least recently sent are forgotten first. Lookups assume a provider
/// that has a prompt's block has the blocks before it (they are sent together), and
/// search for the longest such prefix.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Hashed with a per-process key: prompts are callers' text.
    current: HashSet<u64, RandomState>,
    previous: HashSet<u64, RandomState>,
    per_generation: usize,
}

impl PrefixIndex {
    /// An empty index of at most about `entries` entries.
    #[must_use]
    pub fn new(entries: usize) -> Self {
        PrefixIndex {
            current: HashSet::default(),
            previous: HashSet::default(),
            per_generation: (entries / 2).max(1),
        }
    }

    /// The bound changed (a configuration).
    pub(super) fn resize(&mut self, entries: usize) {
        self.per_generation = (entries / 2).max(1);
        if self.current.len() >= self.per_generation {
            self.previous = std::mem::take(&mut self.current);
            if self.previous.len() > self.per_generation {
                self.previous.clear();
            }
        }
    }

    fn entry(fingerprint: u64, r: ResourceId) -> u64 {
        fingerprint ^ (r.index() as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn has(&self, entry: u64) -> bool {
        self.current.contains(&entry) || self.previous.contains(&entry)
    }

    /// Blocks of `placement`'s prompt that `r` was sent last (a prefix).
    #[must_use]
    pub fn matched(&self, placement: &Placement, r: ResourceId) -> usize {
        let chain = &placement.chain;
        // The longest prefix whose last kept block `r` has: a binary search.
        let (mut lo, mut hi) = (0, chain.len());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.has(Self::entry(chain[mid - 1], r)) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo * STRIDE
    }

    /// `placement`'s prompt was sent to `r`.
    pub fn record(&mut self, placement: &Placement, r: ResourceId) {
        for &fingerprint in placement.chain.iter() {
            if self.current.len() >= self.per_generation {
                self.previous = std::mem::take(&mut self.current);
            }
            self.current.insert(Self::entry(fingerprint, r));
        }
    }

    /// Entries held, and about the bytes they take.
    #[must_use]
    pub fn size(&self) -> (usize, usize) {
        let slots = self.current.capacity() + self.previous.capacity();
        (
            self.current.len() + self.previous.len(),
            slots * (std::mem::size_of::<u64>() + 1),
        )
    }
}

/// How this Edge placed requests by their conversation, and what it remembers to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AffinityFigures {
    /// Requests placed, by why ([`Placed`]), in the order of [`Placed::ALL`].
    pub placed: [u64; 4],
    /// Blocks of prompts ([`BLOCK`] bytes each) a placed request's provider was
    /// remembered to have, summed.
    pub matched_blocks: u64,
    /// Prefix fingerprints remembered (each one provider's block).
    pub prefix_entries: usize,
    /// About the bytes they take.
    pub prefix_bytes: usize,
}

impl Placed {
    /// Every reason, in [`AffinityFigures::placed`]'s order.
    pub const ALL: [Placed; 4] = [
        Placed::Session,
        Placed::Prefix,
        Placed::Anchor,
        Placed::Balance,
    ];
}

impl super::EdgeCore {
    /// How requests were placed by their conversation so far, and the prefix index's
    /// size.
    #[must_use]
    pub fn affinity_figures(&self) -> AffinityFigures {
        let (prefix_entries, prefix_bytes) = self.prefixes.size();
        AffinityFigures {
            placed: self.placed,
            matched_blocks: self.matched_blocks,
            prefix_entries,
            prefix_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(messages: &str) -> Vec<u8> {
        format!(r#"{{"model":"m","stream":true,"messages":[{messages}],"max_tokens":64}}"#)
            .into_bytes()
    }

    fn place(body: &[u8], session: Option<&str>) -> Placement {
        Placement::of(AffinityMode::Prefix, "m", session, body, 2048).expect("placed")
    }

    #[test]
    fn every_turn_of_a_conversation_has_its_first_turns_anchor() {
        let system = r#"{"role":"system","content":"You are terse."}"#;
        let first = format!(r#"{system},{{"role":"user","content":"Plan a \"trip\" to Rome"}}"#);
        let second = format!(
            r#"{first},{{"role":"assistant","content":"Day one: the Forum."}},{{"role":"user","content":"And day two?"}}"#
        );
        let other = format!(r#"{system},{{"role": "user", "content": "Plan a trip to Oslo"}}"#);
        let (a, b, c) = (
            place(&chat(&first), None),
            place(&chat(&second), None),
            place(&chat(&other), None),
        );
        assert_eq!(a.key, b.key, "the anchor ends after the first user message");
        assert_ne!(a.key, c.key, "another conversation");
        assert!(!a.keyed());
        // A session key wins over the anchor, and is the same whatever the prompt.
        let keyed = place(&chat(&second), Some("s-1"));
        assert!(keyed.keyed());
        assert_eq!(keyed.key, place(&chat(&other), Some("s-1")).key);
        // Session mode places only keyed requests; off places nothing.
        assert!(Placement::of(AffinityMode::Session, "m", None, &chat(&first), 2048).is_none());
        assert!(Placement::of(AffinityMode::Off, "m", Some("s"), &chat(&first), 2048).is_none());
        // Another model, another key.
        let there = Placement::of(AffinityMode::Prefix, "n", None, &chat(&first), 2048).unwrap();
        assert_ne!(there.key, a.key);
    }

    #[test]
    fn a_long_first_message_is_anchored_at_the_bound() {
        let shared = "x".repeat(4096);
        let one = chat(&format!(
            r#"{{"role":"user","content":"{shared} first question"}}"#
        ));
        let two = chat(&format!(
            r#"{{"role":"user","content":"{shared} another one"}}"#
        ));
        let (a, b) = (place(&one, None), place(&two, None));
        assert_eq!(a.key, b.key, "both anchored inside the shared prefix");
        assert_eq!(a.anchor_blocks(), 2048 / BLOCK);
        // A long system prompt is all in the anchor, and the first user message after it.
        let system = format!(r#"{{"role":"system","content":"{}"}}"#, "s".repeat(4096));
        let c1 = place(
            &chat(&format!(r#"{system},{{"role":"user","content":"one"}}"#)),
            None,
        );
        let c2 = place(
            &chat(&format!(r#"{system},{{"role":"user","content":"two"}}"#)),
            None,
        );
        assert_ne!(c1.key, c2.key, "two conversations under one system prompt");
        assert!(a.blocks() >= 4096 / BLOCK);
        // A long text is anchored `max` bytes into it; unterminated JSON at the bound
        // from the start.
        assert_eq!(
            anchor_end(br#"[{"role":"user","content":"abcdefghijkl"}]"#, 4),
            31
        );
        assert_eq!(
            anchor_end(br#"[{"role":"user","content":"abcdefghijkl"#, 4),
            4
        );
        // Content before role (alphabetical writers): the same anchor.
        assert_eq!(
            anchor_end(
                br#"[{"content":"sys","role":"system"},{"content":"hello","role":"user"}]"#,
                100
            ),
            53
        );
        assert_eq!(
            anchor_end(
                br#"[{"content":"sys","role":"system"},{"content":"hello there","role":"user"}]"#,
                3
            ),
            50
        );
        assert_eq!(
            anchor_end(br#"[{"role":"user","content":[{"type":"text"}]}]"#, 5),
            6
        );
        assert_eq!(anchor_end(b"\"just a prompt\"", 4), 4);
        assert_eq!(
            anchor_end(br#"[{"role":"user","content":"a\"b"}]"#, 100),
            32
        );
        assert_eq!(anchor_end(b"", 100), 0);
    }

    #[test]
    fn the_index_finds_the_longest_prefix_each_provider_was_sent() {
        let (p, q) = (ResourceId(0), ResourceId(1));
        let mut index = PrefixIndex::new(1 << 16);
        let base = "{\"role\":\"user\",\"content\":\"".to_owned() + &"y".repeat(3000) + "\"}";
        let short = place(&chat(&base), None);
        let long = place(
            &chat(&format!(
                r#"{base},{{"role":"assistant","content":"{}"}}"#,
                "z".repeat(2000)
            )),
            None,
        );
        assert_eq!(index.matched(&long, p), 0);
        index.record(&short, p);
        index.record(&long, q);
        let on_p = index.matched(&long, p);
        assert!(on_p > 0 && on_p <= short.blocks(), "{on_p}");
        assert_eq!(index.matched(&long, q), long.blocks());
        // Bounded: the oldest generation goes.
        let mut small = PrefixIndex::new(8);
        small.record(&long, p);
        assert!(small.size().0 <= 8);
        assert_eq!(small.matched(&short, p), 0, "forgotten");
    }

    #[test]
    fn ranks_are_the_same_for_every_edge_and_spread() {
        let a = place(&chat(r#"{"role":"user","content":"hi"}"#), Some("k"));
        let b = place(&chat(r#"{"role":"user","content":"hi"}"#), Some("k"));
        assert_eq!(a.rank(("n1", "api")), b.rank(("n1", "api")));
        let mut firsts = [0u32; 4];
        for s in 0..4000 {
            let p = place(b"{}", Some(&s.to_string()));
            let best = (0..4)
                .max_by_key(|i| p.rank((&format!("n{i}"), "api")))
                .unwrap();
            firsts[best] += 1;
        }
        for n in firsts {
            assert!((850..1150).contains(&n), "{firsts:?}");
        }
    }
}
