//! The built-in deterministic provider: a configurable reply streamed word by word, with
//! per-token delay and failure injection. It is what the quickstart, the tests and the
//! benchmarks use when no real LLM is present.
//!
//! Options (all strings, from the adapter's `options` map):
//! - `reply`: the text to stream (default `"Hello from the IOP mock provider."`);
//! - `tokens`: how many words to stream, cycling through the reply (default: its length);
//! - `token_delay_ms`: delay before each word (default 20);
//! - `fail`: `never` (default), `always` (fails after START), `after:N` (a retryable
//!   error after N words), or `stall:N` (after N words the answer goes silent, its stream
//!   held open until the Edge cancels it: a provider that hangs midway);
//! - `tool_call`: when set and the request offers `tools` (and does not end with a tool's
//!   result), the run completes with one call to this function (in `openai_tool_calls`),
//!   its arguments filled in from the tool's schema, instead of text;
//! - `dispatch = "tunnel"` (read by the Edge): the Edge tunnels raw OpenAI requests to
//!   this adapter instead of runs, and it answers them as an OpenAI-compatible server
//!   would, embeddings and completions included (see `mock_openai`);
//! - `native_messages = "true"` (read by the Edge): the Edge sends Anthropic Messages
//!   requests to such a tunnelled mock as they came, and it answers them as the Messages
//!   API would;
//! - `tokenize = "true"` (read by the Edge): a tunnelled mock answers vLLM's
//!   `POST /tokenize`, so the Edge counts a prompt's tokens exactly with it.
//!
//! - `resume = "true"` (read by the Edge): a stream lost midway may be continued on this
//!   adapter; the mock continues a final assistant message (`continue_final_message`)
//!   exactly where its own answer to the conversation before it would be.
//!
//! Every answer follows its request's `max_tokens` (words) and `stop` sequences, and says
//! which ended it ([`plan`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use iop_proto_core::RunOutput;
use iop_proto_core::wire::{ErrorDetail, FINISH_REASON_KEY, RunRequest, STOP_SEQUENCE_KEY, Usage};
use iop_shell_common::cancel::Cancel;

use super::{Sink, error};

pub mod plan;

/// When the mock fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fail {
    /// Never.
    Never,
    /// Right after START.
    Always,
    /// After this many words.
    After(usize),
    /// Silent after this many words, until cancelled.
    Stall(usize),
}

/// The mock provider's settings.
#[derive(Clone, Debug)]
pub struct Mock {
    pub(super) words: Vec<String>,
    pub(super) tokens: usize,
    pub(super) delay: Duration,
    pub(super) fail: Fail,
    pub(super) tool_call: Option<String>,
}

impl Mock {
    /// Reads the options; unknown keys are refused so typos do not go unnoticed.
    pub fn from_options(options: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut options: HashMap<&str, &str> = options
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let reply = options
            .remove("reply")
            .unwrap_or("Hello from the IOP mock provider.");
        let words: Vec<String> = reply.split_whitespace().map(str::to_owned).collect();
        if words.is_empty() {
            return Err("option reply must not be empty".into());
        }
        let tokens = match options.remove("tokens") {
            None => words.len(),
            Some(n) => n
                .parse()
                .map_err(|_| format!("option tokens: {n:?} is not a count"))?,
        };
        let delay = match options.remove("token_delay_ms") {
            None => Duration::from_millis(20),
            Some(ms) => Duration::from_millis(
                ms.parse()
                    .map_err(|_| format!("option token_delay_ms: {ms:?} is not a number"))?,
            ),
        };
        let fail = match options.remove("fail") {
            None | Some("never") => Fail::Never,
            Some("always") => Fail::Always,
            Some(other) => {
                let count = |prefix: &str| other.strip_prefix(prefix).and_then(|n| n.parse().ok());
                match (count("after:"), count("stall:")) {
                    (Some(n), _) => Fail::After(n),
                    (_, Some(n)) => Fail::Stall(n),
                    _ => {
                        return Err(format!(
                            "option fail: {other:?} is not never, always, after:N or stall:N"
                        ));
                    }
                }
            }
        };
        let tool_call = options.remove("tool_call").map(str::to_owned);
        // Read by the Edge, not by the adapter.
        options.remove("dispatch");
        options.remove(iop_proto_core::tunnel::Dialect::Messages.option());
        options.remove(iop_proto_core::tunnel::TOKENIZE_OPTION);
        options.remove(iop_proto_core::tunnel::RESUME_OPTION);
        if let Some(key) = options.keys().next() {
            return Err(format!("unknown mock option {key:?}"));
        }
        Ok(Mock {
            words,
            tokens,
            delay,
            fail,
            tool_call,
        })
    }

    /// Streams the reply.
    pub async fn run(&self, request: RunRequest, sink: Sink, cancel: Cancel) {
        if !sink.run(RunOutput::Start).await {
            return;
        }
        let prompt_tokens = (request.input.len() as u64).div_ceil(4);
        if self.fail == Fail::Always {
            let _ = sink
                .run(RunOutput::Error(error(
                    "mock_failure",
                    "injected failure",
                    true,
                )))
                .await;
            return;
        }
        // The input is read off the thread when it is large, like the other adapters'
        // conversions.
        let mock = self.clone();
        let reading = super::convert_input(&request.input, move |input| Ok(mock.plan(input)));
        let read = tokio::select! {
            () = cancel.cancelled() => Err(RunOutput::Cancelled),
            read = reading => read.map_err(RunOutput::Error),
        };
        let plan = match read {
            Ok(plan) => plan,
            Err(output) => {
                let _ = sink.run(output).await;
                return;
            }
        };
        if let Some((name, arguments)) = &plan.tool {
            let calls = serde_json::json!([{
                "id": format!("call_{}", request.run_id),
                "type": "function",
                "function": { "name": name, "arguments": arguments },
            }]);
            let mut metadata = BTreeMap::new();
            metadata.insert("openai_tool_calls".to_owned(), calls.to_string());
            metadata.insert(FINISH_REASON_KEY.to_owned(), plan.finish.to_owned());
            let _ = sink
                .run(RunOutput::Complete {
                    usage: Some(usage(prompt_tokens, plan.tokens)),
                    metadata,
                })
                .await;
            return;
        }
        for (i, piece) in plan.pieces.iter().enumerate() {
            if self.fail == Fail::After(i) {
                let _ = sink.run(RunOutput::Error(injected_failure(i))).await;
                return;
            }
            if self.fail == Fail::Stall(i) {
                cancel.cancelled().await;
            }
            if !self.pause(&cancel).await {
                let _ = sink.run(RunOutput::Cancelled).await;
                return;
            }
            if !sink.run(RunOutput::Delta(piece.clone())).await {
                return;
            }
        }
        let mut metadata = BTreeMap::new();
        metadata.insert(FINISH_REASON_KEY.to_owned(), plan.finish.to_owned());
        if let Some(sequence) = plan.stop_sequence {
            metadata.insert(STOP_SEQUENCE_KEY.to_owned(), sequence);
        }
        let _ = sink
            .run(RunOutput::Complete {
                usage: Some(usage(prompt_tokens, plan.tokens)),
                metadata,
            })
            .await;
    }
}

impl Mock {
    /// Waits the per-token delay; false when the Edge cancelled meanwhile.
    // A zero delay must not round up to the timer's millisecond tick.
    pub(super) async fn pause(&self, cancel: &Cancel) -> bool {
        if self.delay.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = tokio::time::sleep(self.delay) => {}
            }
        }
        !cancel.is_cancelled()
    }

    /// Word `i` of a reply of `count` words, with its trailing space.
    pub(super) fn word(&self, i: usize, count: usize) -> String {
        let word = &self.words[i % self.words.len()];
        if i + 1 == count {
            word.clone()
        } else {
            format!("{word} ")
        }
    }
}

/// The error of `fail = after:N`: a provider failure, so retryable (what the Edge does
/// with it depends on whether the caller had bytes already).
pub(super) fn injected_failure(after: usize) -> ErrorDetail {
    error(
        "mock_failure",
        format!("injected failure after {after} tokens"),
        true,
    )
}

/// Usage of `prompt` and `completion` tokens.
pub(super) fn usage(prompt: u64, completion: u64) -> Usage {
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A run of `input` through a mock that calls `get_weather` when offered tools: its
    /// terminal output.
    async fn tool_run(input: Vec<u8>) -> RunOutput {
        let options: BTreeMap<String, String> =
            [("tool_call".to_owned(), "get_weather".to_owned())].into();
        let mock = Mock::from_options(&options).expect("valid options");
        let (tx, mut rx) = mpsc::channel(64);
        let request = RunRequest {
            run_id: "r1".into(),
            input: input.into(),
            ..RunRequest::default()
        };
        mock.run(request, Sink::new("r1".into(), tx), Cancel::new())
            .await;
        super::super::testing::last_run_output(&mut rx).expect("a terminal output")
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_large_input_offering_tools_is_read_whole_off_the_thread() {
        // Tools after 200 KiB of messages: found only by reading past them, which
        // `offload::run` does on the blocking pool for an input this large.
        let filler = "x".repeat(1000);
        let messages: Vec<_> = (0..200)
            .map(|_| serde_json::json!({"role": "user", "content": filler}))
            .collect();
        let input = serde_json::json!({
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        });
        let input = serde_json::to_vec(&input).expect("json");
        assert!(input.len() >= iop_shell_common::offload::INLINE_MAX);
        match tool_run(input).await {
            RunOutput::Complete { metadata, .. } => {
                assert!(metadata["openai_tool_calls"].contains("get_weather"));
            }
            other => panic!("expected a tool call, got {other:?}"),
        }
        // The same without tools: text.
        let plain = serde_json::to_vec(&serde_json::json!({"messages": messages})).expect("json");
        match tool_run(plain).await {
            RunOutput::Complete { metadata, .. } => {
                assert!(!metadata.contains_key("openai_tool_calls"));
            }
            other => panic!("expected text, got {other:?}"),
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_run_does_not_wait_for_a_conversion_slot() {
        // Every slot is taken by other large conversions: a run cancelled while it waits
        // for one ends at once, cancelled. (Only a mock that calls tools reads its input.)
        let options: BTreeMap<String, String> =
            [("tool_call".to_owned(), "get_weather".to_owned())].into();
        let mock = Mock::from_options(&options).expect("valid options");
        let last = super::super::testing::cancelled_waiting_for_a_slot(|request, sink, cancel| {
            mock.run(request, sink, cancel)
        })
        .await;
        assert!(matches!(last, Some(RunOutput::Cancelled)), "{last:?}");
    }

    #[test]
    fn options_are_validated() {
        let opts = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert!(Mock::from_options(&opts(&[])).is_ok());
        assert_eq!(
            Mock::from_options(&opts(&[("fail", "after:3")])).map(|m| m.fail),
            Ok(Fail::After(3))
        );
        assert_eq!(
            Mock::from_options(&opts(&[("fail", "stall:7")])).map(|m| m.fail),
            Ok(Fail::Stall(7))
        );
        assert!(Mock::from_options(&opts(&[("fail", "sometimes")])).is_err());
        assert!(Mock::from_options(&opts(&[("tokens", "x")])).is_err());
        assert!(Mock::from_options(&opts(&[("replay", "typo")])).is_err());
    }
}
