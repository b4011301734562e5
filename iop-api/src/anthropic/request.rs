//! A Messages request read and translated into the OpenAI chat body every provider
//! shape takes: a normalized run reads it as its input, a tunnel sends it to the
//! provider's `/v1/chat/completions`.
//!
//! Every field is checked as it is translated, and anything the Messages API would refuse
//! is refused here with a 400 that names where (`messages.2.content.0.type: ...`), so a
//! provider never sees half a translation. Text is borrowed from the body where it has no
//! escapes; the body is parsed once and the chat body written once.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::openai::{ApiError, RequestFacts};
use crate::translated::body::{
    Chat, ChatCall, ChatFunction, ChatMessage, ChatTool, Content, FileData, Part, StreamOptions,
    ToolFunction, Turn, Url,
};

/// The system line Claude Code puts first in `system`, whose value changes with every
/// request (a version and a per-request hash): left in, it makes every prompt differ
/// from its first bytes on, and no provider's prefix cache ever hits.
pub const BILLING_HEADER_PREFIX: &str = "x-anthropic-billing-header:";

/// How a request is translated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TranslateOptions {
    /// Keep Claude Code's attribution line ([`BILLING_HEADER_PREFIX`]) in the system
    /// prompt. Off by default: it defeats every provider's prefix cache.
    pub keep_billing_header: bool,
    /// `max_tokens` is required (`/v1/messages`), or not (`count_tokens`).
    pub require_max_tokens: bool,
}

impl Default for TranslateOptions {
    fn default() -> Self {
        TranslateOptions {
            keep_billing_header: false,
            require_max_tokens: true,
        }
    }
}

/// A Messages request, translated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Translated {
    /// What the Edge routes and accounts on: `prompt_tokens` is the estimate over the
    /// translated body (what the model is shown), `include_usage` is always asked of a
    /// stream (the closing `message_delta` carries the usage).
    pub facts: RequestFacts,
    /// The OpenAI chat completions body.
    pub chat: bytes::Bytes,
    /// `stop_sequences`, to say which one ended an answer when the provider names it.
    pub stop_sequences: Vec<String>,
}

impl Translated {
    /// What its response needs to know, served as `run_id` for the caller's `request_id`.
    #[must_use]
    pub fn response_options(
        &self,
        run_id: &str,
        request_id: &str,
    ) -> crate::translated::ResponseOptions {
        crate::translated::ResponseOptions::of(
            &self.facts,
            &self.stop_sequences,
            run_id,
            request_id,
        )
    }
}

/// The top-level members read; the rest (`service_tier`, `container`, ...) are ignored,
/// as a provider without them would.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    stop_sequences: Option<&'a RawValue>,
    #[serde(borrow)]
    temperature: Option<&'a RawValue>,
    #[serde(borrow)]
    top_p: Option<&'a RawValue>,
    #[serde(borrow)]
    top_k: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_choice: Option<&'a RawValue>,
}

/// A present, non-null member.
fn given(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| v.get() != "null")
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message, Some("invalid_request_error"))
}

/// `raw` read as `T`, or a 400 naming `at`.
fn read<'a, T: Deserialize<'a>>(raw: &'a RawValue, at: &str, what: &str) -> Result<T, ApiError> {
    serde_json::from_str(raw.get()).map_err(|_| invalid(format!("{at}: {what}")))
}

/// Reads a Messages body and translates it into a chat completions body, or refuses it
/// with the 400 the Messages API would answer.
pub fn translate(raw: &[u8], options: TranslateOptions) -> Result<Translated, ApiError> {
    let Ok(text) = std::str::from_utf8(raw) else {
        return Err(invalid("invalid JSON: the request body is not UTF-8"));
    };
    let body: Body<'_> = match serde_json::from_str(text) {
        Ok(body) => body,
        Err(err) if err.is_data() => {
            return Err(invalid("the request body must be a JSON object"));
        }
        Err(err) => return Err(invalid(format!("invalid JSON: {err}"))),
    };
    let model: Cow<'_, str> = match given(body.model) {
        Some(m) => read(m, "model", "must be a string")?,
        None => return Err(invalid("model: Field required")),
    };
    let max_tokens = match given(body.max_tokens) {
        Some(n) => match n.get().parse::<u64>() {
            Ok(n) if n >= 1 => Some(n),
            _ => return Err(invalid("max_tokens: must be an integer of at least 1")),
        },
        None if options.require_max_tokens => {
            return Err(invalid("max_tokens: Field required"));
        }
        None => None,
    };
    let stream = match given(body.stream) {
        Some(v) => read::<bool>(v, "stream", "must be a boolean")?,
        None => false,
    };
    let mut messages = Vec::new();
    if let Some(system) = given(body.system) {
        let text = system_text(system, options.keep_billing_header)?;
        if !text.is_empty() {
            messages.push(ChatMessage::text("system", text));
        }
    }
    let Some(list) = given(body.messages) else {
        return Err(invalid("messages: Field required"));
    };
    let list: Vec<&RawValue> = read(list, "messages", "must be an array")?;
    if list.is_empty() {
        return Err(invalid("messages: at least one message is required"));
    }
    for (i, message) in list.into_iter().enumerate() {
        translate_message(message, i, &mut messages)?;
    }
    let stop_sequences: Vec<String> = match given(body.stop_sequences) {
        Some(v) => read(v, "stop_sequences", "must be an array of strings")?,
        None => Vec::new(),
    };
    for (name, value) in [
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
    ] {
        if let Some(v) = given(value)
            && v.get().parse::<f64>().is_err()
        {
            return Err(invalid(format!("{name}: must be a number")));
        }
    }
    let user = match given(body.metadata) {
        Some(m) => {
            let metadata: Metadata<'_> = read(m, "metadata", "must be an object")?;
            metadata.user_id
        }
        None => None,
    };
    let tools = match given(body.tools) {
        Some(t) => translate_tools(t)?,
        None => Vec::new(),
    };
    let (tool_choice, parallel) = match given(body.tool_choice) {
        Some(c) => translate_tool_choice(c, &tools)?,
        None => (None, None),
    };
    let wants_tools = !tools.is_empty() && tool_choice.as_ref().is_none_or(|c| c.0 != "\"none\"");
    let chat = Chat {
        model: &model,
        messages: messages.into_iter().map(Turn::Message).collect(),
        max_tokens,
        stop: (!stop_sequences.is_empty()).then_some(&stop_sequences),
        temperature: given(body.temperature),
        top_p: given(body.top_p),
        top_k: given(body.top_k),
        user,
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice: tool_choice.map(|c| c.raw()),
        parallel_tool_calls: parallel,
        response_format: None,
        stream: stream.then_some(true),
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
    };
    let session = chat.user.as_deref().map(str::to_owned);
    let written = serde_json::to_vec(&chat).map_err(|err| invalid(err.to_string()))?;
    let prompt_tokens = crate::openai::estimate_tokens(&written);
    Ok(Translated {
        facts: RequestFacts {
            model: model.into_owned(),
            stream,
            include_usage: stream,
            wants_tools,
            prompt_tokens,
            max_tokens,
            session: session.filter(|s| !s.is_empty() && s.len() <= 256),
        },
        chat: bytes::Bytes::from(written),
        stop_sequences,
    })
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

/// The system prompt as one text: a string, or text blocks joined by newlines; Claude
/// Code's attribution line dropped unless `keep_billing` is set.
fn system_text(raw: &RawValue, keep_billing: bool) -> Result<Cow<'_, str>, ApiError> {
    if raw.get().starts_with('"') {
        let text: Cow<'_, str> = read(raw, "system", "must be a string or text blocks")?;
        if keep_billing || !text.starts_with(BILLING_HEADER_PREFIX) {
            return Ok(text);
        }
        let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
        return Ok(Cow::Owned(rest.to_owned()));
    }
    let blocks: Vec<&RawValue> = read(raw, "system", "must be a string or text blocks")?;
    let mut texts: Vec<Cow<'_, str>> = Vec::with_capacity(blocks.len());
    for (i, block) in blocks.into_iter().enumerate() {
        let at = format!("system.{i}");
        let head: BlockHead<'_> = read(block, &at, "must be a content block")?;
        if head.r#type != "text" {
            return Err(invalid(format!(
                "{at}.type: system blocks must be text, not {:?}",
                head.r#type
            )));
        }
        let block: TextBlock<'_> = read(block, &at, "text block needs a string text")?;
        if !keep_billing && block.text.starts_with(BILLING_HEADER_PREFIX) {
            continue;
        }
        texts.push(block.text);
    }
    Ok(match texts.len() {
        0 => Cow::Borrowed(""),
        1 => texts.pop().unwrap_or_default(),
        _ => Cow::Owned(texts.join("\n")),
    })
}

#[derive(Deserialize)]
struct BlockHead<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
}

#[derive(Deserialize)]
struct TextBlock<'a> {
    #[serde(borrow)]
    text: Cow<'a, str>,
}

#[derive(Deserialize)]
struct MessageIn<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct ToolUse<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow)]
    input: &'a RawValue,
}

#[derive(Deserialize)]
struct ToolResult<'a> {
    #[serde(borrow)]
    tool_use_id: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    is_error: Option<bool>,
}

#[derive(Deserialize)]
struct Source<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
    #[serde(borrow, default)]
    media_type: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    data: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    url: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MediaBlock<'a> {
    #[serde(borrow)]
    source: Source<'a>,
    #[serde(borrow, default)]
    title: Option<Cow<'a, str>>,
}

/// One Messages message into chat messages: a user turn's tool results become `tool`
/// messages (first, in order), its other blocks one user message; an assistant turn's
/// text becomes its content and its `tool_use` blocks its `tool_calls`. Thinking blocks
/// an assistant turn carries back are the model's own and are not shown to it again.
fn translate_message<'a>(
    raw: &'a RawValue,
    i: usize,
    out: &mut Vec<ChatMessage<'a>>,
) -> Result<(), ApiError> {
    let at = format!("messages.{i}");
    let message: MessageIn<'a> = read(raw, &at, "must be an object with role and content")?;
    let role = match &*message.role {
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(invalid(format!(
                "{at}.role: must be \"user\" or \"assistant\", not {other:?}"
            )));
        }
    };
    let content = message.content;
    if content.get().starts_with('"') {
        let text: Cow<'a, str> = read(content, &format!("{at}.content"), "must be a string")?;
        out.push(ChatMessage::text(role, text));
        return Ok(());
    }
    let blocks: Vec<&'a RawValue> = read(
        content,
        &format!("{at}.content"),
        "must be a string or an array of content blocks",
    )?;
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut trailing_images = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content.{j}");
        let head: BlockHead<'a> = read(block, &at, "must be a content block with a type")?;
        let assistant = role == "assistant";
        match (&*head.r#type, assistant) {
            ("text", _) => {
                let text: TextBlock<'a> = read(block, &at, "text block needs a string text")?;
                parts.push(Part::Text { text: text.text });
            }
            ("image", false) => parts.push(image(block, &at)?),
            ("document", false) => parts.push(document(block, &at)?),
            ("tool_use", true) => {
                let call: ToolUse<'a> = read(
                    block,
                    &at,
                    "tool_use block needs a string id, a string name and an input object",
                )?;
                if !call.input.get().starts_with('{') {
                    return Err(invalid(format!("{at}.input: must be an object")));
                }
                calls.push(ChatCall {
                    id: call.id,
                    r#type: "function",
                    function: ChatFunction {
                        name: call.name,
                        arguments: Cow::Borrowed(call.input.get()),
                    },
                });
            }
            ("tool_result", false) => {
                let result: ToolResult<'a> =
                    read(block, &at, "tool_result block needs a string tool_use_id")?;
                let (text, images) = tool_result_content(result.content, &at)?;
                let text = if result.is_error == Some(true) {
                    Cow::Owned(format!("Error: {text}"))
                } else {
                    text
                };
                out.push(ChatMessage {
                    role: "tool",
                    content: Some(Content::Text(text)),
                    tool_calls: Vec::new(),
                    tool_call_id: Some(result.tool_use_id),
                });
                trailing_images.extend(images);
            }
            ("thinking" | "redacted_thinking", true) => {}
            (known @ ("image" | "document" | "tool_result"), true) => {
                return Err(invalid(format!(
                    "{at}.type: {known} blocks belong in user messages"
                )));
            }
            (known @ ("tool_use" | "thinking" | "redacted_thinking"), false) => {
                return Err(invalid(format!(
                    "{at}.type: {known} blocks belong in assistant messages"
                )));
            }
            (other, _) => {
                return Err(invalid(format!(
                    "{at}.type: unknown content block type {other:?}"
                )));
            }
        }
    }
    // Images a tool returned: shown to the model right after the results, as the user's.
    parts.splice(0..0, trailing_images);
    let content = Content::of(parts);
    if role == "assistant" {
        if content.is_some() || !calls.is_empty() {
            out.push(ChatMessage {
                role,
                content,
                tool_calls: calls,
                tool_call_id: None,
            });
        }
    } else if let Some(content) = content {
        out.push(ChatMessage {
            role,
            content: Some(content),
            tool_calls: Vec::new(),
            tool_call_id: None,
        });
    }
    Ok(())
}

/// A tool result's content as text (text blocks joined by newlines) and the images it
/// returned.
fn tool_result_content<'a>(
    raw: Option<&'a RawValue>,
    at: &str,
) -> Result<(Cow<'a, str>, Vec<Part<'a>>), ApiError> {
    let Some(raw) = given(raw) else {
        return Ok((Cow::Borrowed(""), Vec::new()));
    };
    if raw.get().starts_with('"') {
        return Ok((
            read(raw, &format!("{at}.content"), "must be a string")?,
            Vec::new(),
        ));
    }
    let blocks: Vec<&'a RawValue> = read(
        raw,
        &format!("{at}.content"),
        "must be a string or an array of content blocks",
    )?;
    let mut texts: Vec<Cow<'a, str>> = Vec::new();
    let mut images = Vec::new();
    for (k, block) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content.{k}");
        let head: BlockHead<'a> = read(block, &at, "must be a content block with a type")?;
        match &*head.r#type {
            "text" => {
                let text: TextBlock<'a> = read(block, &at, "text block needs a string text")?;
                texts.push(text.text);
            }
            "image" => images.push(image(block, &at)?),
            "document" => match document(block, &at)? {
                Part::Text { text } => texts.push(text),
                other => images.push(other),
            },
            other => {
                return Err(invalid(format!(
                    "{at}.type: a tool result holds text, image or document blocks, not {other:?}"
                )));
            }
        }
    }
    let text = match texts.len() {
        0 => Cow::Borrowed(""),
        1 => texts.pop().unwrap_or_default(),
        _ => Cow::Owned(texts.join("\n")),
    };
    Ok((text, images))
}

/// Image media types the Messages API takes.
const IMAGE_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// An image block as an `image_url` part: a data URL for base64 data, or the URL.
fn image<'a>(raw: &'a RawValue, at: &str) -> Result<Part<'a>, ApiError> {
    let block: MediaBlock<'a> = read(raw, at, "image block needs a source object")?;
    let source = block.source;
    let url = match &*source.r#type {
        "base64" => {
            let media = source.media_type.as_deref().unwrap_or("");
            if !IMAGE_TYPES.contains(&media) {
                return Err(invalid(format!(
                    "{at}.source.media_type: must be one of {}, not {media:?}",
                    IMAGE_TYPES.join(", ")
                )));
            }
            let data = source
                .data
                .ok_or_else(|| invalid(format!("{at}.source.data: Field required")))?;
            format!("data:{media};base64,{data}")
        }
        "url" => source
            .url
            .ok_or_else(|| invalid(format!("{at}.source.url: Field required")))?
            .into_owned(),
        other => {
            return Err(invalid(format!(
                "{at}.source.type: an image source is base64 or url, not {other:?}"
            )));
        }
    };
    Ok(Part::Image {
        image_url: Url { url },
    })
}

/// A document block: plain text (or text blocks) as a text part, a base64 PDF as a
/// `file` part.
fn document<'a>(raw: &'a RawValue, at: &str) -> Result<Part<'a>, ApiError> {
    let block: MediaBlock<'a> = read(raw, at, "document block needs a source object")?;
    let source = block.source;
    match &*source.r#type {
        "text" => Ok(Part::Text {
            text: source
                .data
                .ok_or_else(|| invalid(format!("{at}.source.data: Field required")))?,
        }),
        "content" => {
            let inner = source
                .content
                .ok_or_else(|| invalid(format!("{at}.source.content: Field required")))?;
            let (text, images) = tool_result_content(Some(inner), &format!("{at}.source"))?;
            if !images.is_empty() {
                return Err(invalid(format!(
                    "{at}.source.content: a document's content blocks must be text"
                )));
            }
            Ok(Part::Text { text })
        }
        "base64" => {
            let media = source.media_type.as_deref().unwrap_or("");
            if media != "application/pdf" {
                return Err(invalid(format!(
                    "{at}.source.media_type: a base64 document is application/pdf, not {media:?}"
                )));
            }
            let data = source
                .data
                .ok_or_else(|| invalid(format!("{at}.source.data: Field required")))?;
            Ok(Part::File {
                file: FileData {
                    file_data: format!("data:application/pdf;base64,{data}"),
                    filename: block.title.map(Cow::into_owned),
                },
            })
        }
        other => Err(invalid(format!(
            "{at}.source.type: a document source is text, content or base64 here, not {other:?}"
        ))),
    }
}

#[derive(Deserialize)]
struct ToolIn<'a> {
    #[serde(borrow, default)]
    r#type: Option<Cow<'a, str>>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow, default)]
    description: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input_schema: Option<&'a RawValue>,
}

/// Client tools as OpenAI functions. Anthropic's server tools (`web_search_...`,
/// `bash_...`) run on Anthropic's side and no provider here has them: refused.
fn translate_tools(raw: &RawValue) -> Result<Vec<ChatTool<'_>>, ApiError> {
    let list: Vec<&RawValue> = read(raw, "tools", "must be an array of tools")?;
    let mut tools = Vec::with_capacity(list.len());
    for (i, tool) in list.into_iter().enumerate() {
        let at = format!("tools.{i}");
        let tool: ToolIn<'_> = read(tool, &at, "a tool needs a string name")?;
        if let Some(kind) = tool.r#type.as_deref()
            && kind != "custom"
        {
            return Err(invalid(format!(
                "{at}.type: {kind:?} is a tool Anthropic runs itself; only custom tools \
                 (a name and an input_schema) are served here"
            )));
        }
        let Some(schema) = given(tool.input_schema) else {
            return Err(invalid(format!("{at}.input_schema: Field required")));
        };
        if !schema.get().starts_with('{') {
            return Err(invalid(format!("{at}.input_schema: must be an object")));
        }
        tools.push(ChatTool {
            r#type: "function",
            function: ToolFunction {
                name: tool.name,
                description: tool.description,
                parameters: schema,
                strict: None,
            },
        });
    }
    Ok(tools)
}

#[derive(Deserialize)]
struct ToolChoiceIn<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(default)]
    disable_parallel_tool_use: Option<bool>,
}

/// A written `tool_choice` (JSON text).
struct Choice(String);

impl Choice {
    fn raw(self) -> Box<RawValue> {
        RawValue::from_string(self.0)
            .unwrap_or_else(|_| RawValue::from_string("\"auto\"".to_owned()).unwrap_or_default())
    }
}

/// `tool_choice`: `auto`, `any` (OpenAI's `required`), `tool` (the named function, which
/// must be among the tools), `none`; `disable_parallel_tool_use` as
/// `parallel_tool_calls: false`.
fn translate_tool_choice(
    raw: &RawValue,
    tools: &[ChatTool<'_>],
) -> Result<(Option<Choice>, Option<bool>), ApiError> {
    let choice: ToolChoiceIn<'_> = read(raw, "tool_choice", "must be an object with a type")?;
    let parallel = choice.disable_parallel_tool_use.map(|d| !d);
    let written = match &*choice.r#type {
        "auto" => "\"auto\"".to_owned(),
        "any" => "\"required\"".to_owned(),
        "none" => "\"none\"".to_owned(),
        "tool" => {
            let name = choice
                .name
                .ok_or_else(|| invalid("tool_choice.name: Field required"))?;
            if !tools.iter().any(|t| t.function.name == name) {
                return Err(invalid(format!(
                    "tool_choice.name: no tool named {name:?} in tools"
                )));
            }
            serde_json::json!({"type": "function", "function": {"name": name}}).to_string()
        }
        other => {
            return Err(invalid(format!(
                "tool_choice.type: must be auto, any, tool or none, not {other:?}"
            )));
        }
    };
    Ok((Some(Choice(written)), parallel))
}
