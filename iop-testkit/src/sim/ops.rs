//! The operations a seed makes: the generated list, with broken, stubborn and misconfigured nodes woven in from streams of their own.

use super::*;
use crate::rng::Rng;

/// Breaks providers in two fifths of the worlds (unreachable, or answering 503), from a
/// stream of its own.
pub(super) fn weave_broken_providers(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0x3C6E_F372_FE94_F82B);
    if !rng.chance(40) {
        return;
    }
    for _ in 0..rng.range(1, 3) {
        let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
        let node = u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
        let mode = if rng.chance(50) {
            Mode::Refuse
        } else {
            Mode::Unavailable
        };
        ops.insert(at.min(ops.len()), Op::Provider { node, mode });
    }
}

/// Makes a provider slow to stop after a cancel ([`Mode::Stubborn`]) in a fifth of the
/// worlds, from a stream of its own.
pub(super) fn weave_stubborn_providers(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0xA54F_F53A_5F1D_36F1);
    if !rng.chance(20) {
        return;
    }
    let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
    let node = u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
    ops.insert(
        at.min(ops.len()),
        Op::Provider {
            node,
            mode: Mode::Stubborn,
        },
    );
}

/// Adds misconfigured siblings to a third of the worlds, drawn from a stream of their
/// own so that the rest of a seed's operations stay what [`generate`] makes.
pub(super) fn weave_bad_siblings(seed: u64, ops: &mut Vec<Op>) {
    let mut rng = Rng::new(seed ^ 0xBB67_AE85_84CA_A73B);
    if !rng.chance(33) {
        return;
    }
    for _ in 0..rng.range(1, 3) {
        let at = usize::try_from(rng.below(ops.len() as u64 + 1)).unwrap_or(0);
        let node = (!rng.chance(30)).then(|| u8::try_from(rng.below(NODES as u64)).unwrap_or(0));
        let for_ms = u16::try_from(rng.range(500, 6000)).unwrap_or(1000);
        ops.insert(at.min(ops.len()), Op::BadSibling { node, for_ms });
    }
}

/// Generates `len` weighted operations from `seed`.
#[must_use]
pub fn generate(seed: u64, len: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let node = |rng: &mut Rng| u8::try_from(rng.below(NODES as u64)).unwrap_or(0);
    let ms = |rng: &mut Rng, lo: u64, hi: u64| u16::try_from(rng.range(lo, hi)).unwrap_or(u16::MAX);
    (0..len)
        .map(|_| match rng.below(100) {
            0..=27 => Op::Advance(ms(&mut rng, 1, 600)),
            28..=29 => Op::Garble {
                node: node(&mut rng),
            },
            30..=59 => Op::Submit {
                model: u8::try_from(rng.below(MODELS as u64)).unwrap_or(0),
                long: rng.chance(25),
                timeout_ms: ms(&mut rng, 300, 5000),
                cancel_after_ms: rng.chance(20).then(|| ms(&mut rng, 1, 800)),
                tunnel_only: rng.chance(25),
            },
            60..=64 => Op::Burst {
                model: u8::try_from(rng.below(MODELS as u64)).unwrap_or(0),
                count: u8::try_from(rng.range(3, 12)).unwrap_or(3),
            },
            65..=67 => Op::Crash {
                node: node(&mut rng),
                restart_after_ms: ms(&mut rng, 0, 1500),
            },
            68..=69 => Op::Stop {
                node: node(&mut rng),
                restart_after_ms: ms(&mut rng, 0, 1500),
                overlap: rng.chance(50),
            },
            70..=74 => Op::Freeze {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            75..=78 => Op::Partition {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            79..=82 => Op::Disconnect {
                node: node(&mut rng),
            },
            83..=85 => Op::Impostor {
                node: node(&mut rng),
                for_ms: ms(&mut rng, 50, 1500),
            },
            86..=89 => Op::Refresh,
            _ => Op::Provider {
                node: node(&mut rng),
                mode: match rng.below(10) {
                    0..=3 => Mode::Normal,
                    4..=5 => Mode::Slow,
                    6..=7 => Mode::Fail,
                    8 => Mode::Silent,
                    _ => Mode::Hang,
                },
            },
        })
        .collect()
}
