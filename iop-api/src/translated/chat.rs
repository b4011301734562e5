//! A provider's OpenAI chat completion read back into a dialect's [`Compose`]: a whole
//! `chat.completion`, the `chat.completion.chunk`s of its stream (split from the SSE body
//! however it arrives), and its error bodies.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Compose, MessageUsage, StopReason};

/// Longest SSE line kept while its end has not arrived (a chunk is far smaller).
pub(super) const MAX_LINE: usize = 16 << 20;

#[derive(Deserialize, Default)]
#[serde(default)]
struct UsageIn {
    prompt_tokens: u64,
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PromptDetails {
    cached_tokens: Option<u64>,
}

impl UsageIn {
    fn message_usage(&self) -> MessageUsage {
        MessageUsage::from_openai(
            self.prompt_tokens,
            self.completion_tokens,
            self.prompt_tokens_details
                .as_ref()
                .and_then(|d| d.cached_tokens),
        )
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct CallIn {
    index: Option<u64>,
    id: Option<String>,
    function: Option<FunctionIn>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct FunctionIn {
    name: Option<String>,
    /// A string as OpenAI writes it; some servers write the object itself.
    arguments: Option<Box<RawValue>>,
}

impl FunctionIn {
    fn arguments(&self) -> String {
        match &self.arguments {
            None => String::new(),
            Some(raw) if raw.get().starts_with('"') => {
                serde_json::from_str(raw.get()).unwrap_or_default()
            }
            Some(raw) if raw.get() == "null" => String::new(),
            Some(raw) => raw.get().to_owned(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Said {
    content: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Vec<CallIn>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ChoiceIn {
    message: Option<Said>,
    delta: Option<Said>,
    finish_reason: Option<String>,
    /// vLLM's: the stop string that ended the answer (a token id for a stop token).
    stop_reason: Option<Box<RawValue>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ChatIn {
    choices: Vec<ChoiceIn>,
    usage: Option<UsageIn>,
    error: Option<Box<RawValue>>,
}

/// A tool call being streamed.
#[derive(Debug, Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// What a provider's answer said, read chunk by chunk (or whole), into a [`Compose`].
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// Tool calls by index; the one being streamed is the last.
    calls: BTreeMap<u64, Call>,
    finish: Option<String>,
    stop_string: Option<String>,
    usage: Option<MessageUsage>,
    /// Calls handed to the builder (their ids when the provider gave none).
    written: u64,
}

/// A chunk the provider sent that was an error, with its message.
pub(super) struct InStreamError(pub(super) String);

impl Reader {
    /// One `chat.completion.chunk` (or a whole `chat.completion`) read into `builder`.
    pub(super) fn read<C: Compose>(
        &mut self,
        payload: &[u8],
        run_id: &str,
        builder: &mut C,
    ) -> Result<(), InStreamError> {
        let Ok(chat) = serde_json::from_slice::<ChatIn>(payload) else {
            // Not a chunk (a comment-like payload some servers send): nothing said.
            return Ok(());
        };
        if let Some(error) = chat.error {
            return Err(InStreamError(error_message(error.get().as_bytes())));
        }
        if let Some(usage) = &chat.usage {
            self.usage = Some(usage.message_usage());
        }
        let Some(choice) = chat.choices.into_iter().next() else {
            return Ok(());
        };
        if let Some(said) = choice.message.or(choice.delta) {
            if let Some(thinking) = said
                .reasoning_content
                .as_deref()
                .or(said.reasoning.as_deref())
            {
                builder.thinking(thinking);
            }
            if let Some(text) = said.content.as_deref() {
                builder.text(text);
            }
            for (position, part) in said.tool_calls.unwrap_or_default().into_iter().enumerate() {
                let index = part.index.unwrap_or(position as u64);
                // A new index: the calls before it are complete.
                let done: Vec<u64> = self.calls.range(..index).map(|(i, _)| *i).collect();
                for i in done {
                    self.flush(i, run_id, builder);
                }
                let call = self.calls.entry(index).or_default();
                if let Some(id) = part.id {
                    call.id.push_str(&id);
                }
                if let Some(function) = &part.function {
                    if let Some(name) = &function.name {
                        call.name.push_str(name);
                    }
                    call.arguments.push_str(&function.arguments());
                }
            }
        }
        if let Some(finish) = choice.finish_reason {
            self.finish = Some(finish);
        }
        if let Some(stop) = choice.stop_reason
            && let Ok(text) = serde_json::from_str::<String>(stop.get())
        {
            self.stop_string = Some(text);
        }
        Ok(())
    }

    fn flush<C: Compose>(&mut self, index: u64, run_id: &str, builder: &mut C) {
        if let Some(call) = self.calls.remove(&index) {
            let id = if call.id.is_empty() {
                format!("{}_{run_id}_{}", C::CALL_ID_PREFIX, self.written)
            } else {
                call.id
            };
            self.written += 1;
            builder.tool(&id, &call.name, &call.arguments);
        }
    }

    /// The end of the answer: the calls still open, then the end itself. The stop reason
    /// is `stop_sequence` when the provider named a stop string among `stop_sequences`.
    pub(super) fn finish<C: Compose>(
        &mut self,
        run_id: &str,
        stop_sequences: &[String],
        builder: &mut C,
    ) -> Option<serde_json::Value> {
        let open: Vec<u64> = self.calls.keys().copied().collect();
        let had_calls = self.written > 0 || !open.is_empty();
        for i in open {
            self.flush(i, run_id, builder);
        }
        let mut reason = StopReason::of_finish(self.finish.as_deref());
        let sequence = self
            .stop_string
            .as_deref()
            .filter(|s| stop_sequences.iter().any(|q| q == s));
        // Some servers end a call with `stop`: the answer is a tool call all the same.
        if reason == StopReason::EndTurn && had_calls {
            reason = StopReason::ToolUse;
        }
        if reason == StopReason::EndTurn && sequence.is_some() {
            reason = StopReason::StopSequence;
        }
        builder.finish(reason, sequence, self.usage)
    }
}

/// The message of an error body in OpenAI's shape (`{"error": {"message"}}`,
/// `{"error": "..."}`, `{"message"}`, `{"detail"}`), else its text.
pub(crate) fn error_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ErrorIn {
        Wrapped { error: Box<RawValue> },
        Message { message: String },
        Detail { detail: serde_json::Value },
    }
    #[derive(Deserialize)]
    struct Inner {
        message: String,
    }
    let text = String::from_utf8_lossy(body);
    match serde_json::from_slice::<ErrorIn>(body) {
        Ok(ErrorIn::Wrapped { error }) => serde_json::from_str::<Inner>(error.get())
            .map(|e| e.message)
            .or_else(|_| serde_json::from_str::<String>(error.get()))
            .unwrap_or_else(|_| error.get().to_owned()),
        Ok(ErrorIn::Message { message }) => message,
        Ok(ErrorIn::Detail { detail }) => match detail {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        },
        Err(_) => {
            let trimmed = text.trim();
            let end = trimmed
                .char_indices()
                .nth(512)
                .map_or(trimmed.len(), |(i, _)| i);
            trimmed[..end].to_owned()
        }
    }
}

/// The prompt's tokens and the model's context, `(N, M)`, when a provider's error says
/// the prompt did not fit, in the words of vLLM and OpenAI (`maximum context length is M
/// tokens. However, you requested N tokens`), SGLang (`The input (N tokens) is longer
/// than the model's context length (M tokens)`) or llama.cpp (`n_prompt_tokens`,
/// `n_ctx`). Claude Code compacts a conversation only on the Messages API's own words
/// for this, so they are what the caller is answered.
#[must_use]
pub fn context_overflow(body: &[u8]) -> Option<(u64, u64)> {
    #[derive(Deserialize)]
    struct LlamaCpp {
        error: LlamaError,
    }
    #[derive(Deserialize)]
    struct LlamaError {
        n_prompt_tokens: u64,
        n_ctx: u64,
    }
    if let Ok(llama) = serde_json::from_slice::<LlamaCpp>(body) {
        return Some((llama.error.n_prompt_tokens, llama.error.n_ctx));
    }
    let message = error_message(body);
    let numbers = || {
        message
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse::<u64>().ok())
    };
    let lower = message.to_ascii_lowercase();
    if let Some(at) = lower.find("maximum context length is") {
        let mut after = lower[at..]
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse::<u64>().ok());
        let max = after.next()?;
        let tokens = after.next()?;
        return Some((tokens, max));
    }
    if lower.contains("longer than the model's context length") {
        let mut all = numbers();
        let tokens = all.next()?;
        let max = all.next()?;
        return Some((tokens, max));
    }
    None
}

/// The lines of an SSE body as it arrives in pieces: each `data:` payload whole.
#[derive(Debug, Default)]
pub(super) struct SseLines {
    partial: Vec<u8>,
}

impl SseLines {
    /// Adds `bytes` and hands each complete `data:` payload to `each`; `false` when a
    /// line grew past [`MAX_LINE`] without ending.
    pub(super) fn push(&mut self, bytes: &[u8], mut each: impl FnMut(&[u8])) -> bool {
        let mut rest = bytes;
        while let Some(end) = memchr::memchr(b'\n', rest) {
            let (line, after) = rest.split_at(end);
            rest = &after[1..];
            if self.partial.is_empty() {
                data_line(line, &mut each);
            } else {
                self.partial.extend_from_slice(line);
                let whole = std::mem::take(&mut self.partial);
                data_line(&whole, &mut each);
            }
        }
        self.partial.extend_from_slice(rest);
        self.partial.len() <= MAX_LINE
    }

    /// The body ended: a last line that had no newline.
    pub(super) fn end(&mut self, mut each: impl FnMut(&[u8])) {
        let whole = std::mem::take(&mut self.partial);
        data_line(&whole, &mut each);
    }
}

fn data_line(line: &[u8], each: &mut impl FnMut(&[u8])) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if let Some(payload) = line.strip_prefix(b"data:") {
        let payload = payload.strip_prefix(b" ").unwrap_or(payload);
        each(payload);
    }
}
