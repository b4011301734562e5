//! A Responses request read and translated into the OpenAI chat body every provider
//! shape takes: a normalized run reads it as its input, a tunnel sends it to the
//! provider's `/v1/chat/completions`.
//!
//! Every field is checked as it is translated, and anything the Responses API would
//! refuse, or that no chat provider can do (built-in and custom tools, stored items by
//! reference), is refused here with a 400 that names where (`input[2].content[0].type:
//! ...`), so a provider never sees half a translation.

use std::borrow::Cow;
use std::sync::LazyLock;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::openai::{ApiError, RequestFacts};
use crate::translated::ResponseOptions;
use crate::translated::body::{
    Chat, ChatCall, ChatFunction, ChatMessage, ChatTool, Content, FileData, Part, StreamOptions,
    ToolFunction, Turn, Url,
};

/// A Responses request, translated.
#[derive(Clone, Debug, PartialEq)]
pub struct Translated {
    /// What the Edge routes and accounts on: `prompt_tokens` is the estimate over the
    /// translated body, `include_usage` is always asked of a stream (the terminal event
    /// carries the usage).
    pub facts: RequestFacts,
    /// The OpenAI chat completions body.
    pub chat: bytes::Bytes,
    /// Whether the response is kept for a later turn (`store`, the API's default).
    pub store: bool,
    /// The response this turn continues, if any.
    pub previous_response_id: Option<String>,
    /// The conversation to store with this turn's answer: the stored context it
    /// continued, then this turn's input, as a JSON array of chat messages (the
    /// instructions are not part of it, as the API carries them over no turn).
    pub conversation: String,
    /// Members of the request the response repeats.
    pub echo: Map<String, Value>,
}

impl Translated {
    /// What its response needs to know, served as `run_id` for the caller's
    /// `request_id`, made at `created` (Unix seconds).
    #[must_use]
    pub fn response_options(
        &self,
        run_id: &str,
        request_id: &str,
        created: u64,
    ) -> ResponseOptions {
        let mut options = ResponseOptions::of(&self.facts, &[], run_id, request_id).at(created);
        options.echo.clone_from(&self.echo);
        options
    }
}

/// The top-level members read; the rest (`include`, `truncation`, `reasoning`,
/// `service_tier`, ...) are ignored, as a provider without them would.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    #[serde(borrow)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_choice: Option<&'a RawValue>,
    #[serde(borrow)]
    parallel_tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    temperature: Option<&'a RawValue>,
    #[serde(borrow)]
    top_p: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt_cache_key: Option<&'a RawValue>,
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
}

/// A member that is absent or `null` is not given.
fn given(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|v| v.get() != "null")
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message, Some("invalid_request"))
}

fn unsupported(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message, Some("unsupported_parameter"))
}

fn read<'a, T: Deserialize<'a>>(raw: &'a RawValue, at: &str, what: &str) -> Result<T, ApiError> {
    serde_json::from_str(raw.get()).map_err(|_| invalid(format!("{at}: {what}")))
}

/// The `previous_response_id` a Responses body names, read before the translation (the
/// stored conversation it names is the translation's input); `Ok(None)` when it names
/// none, the 400 of a body that is not a JSON object.
pub fn previous_response_id(raw: &[u8]) -> Result<Option<String>, ApiError> {
    #[derive(Deserialize)]
    struct Head<'a> {
        #[serde(borrow)]
        previous_response_id: Option<&'a RawValue>,
    }
    let head: Head<'_> =
        serde_json::from_slice(raw).map_err(|err| invalid(format!("invalid JSON: {err}")))?;
    given(head.previous_response_id)
        .map(|id| read(id, "previous_response_id", "must be a string"))
        .transpose()
}

/// `POST /v1/responses`: the chat body of a Responses request, with `context` the stored
/// conversation its `previous_response_id` names (a JSON array of chat messages), or the
/// 400 of a bad body.
pub fn translate(raw: &[u8], context: Option<&str>) -> Result<Translated, ApiError> {
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
        None => {
            return Err(ApiError::bad_request(
                "you must provide a model parameter",
                Some("missing_model"),
            ));
        }
    };
    let max_tokens = match given(body.max_output_tokens) {
        Some(n) => match n.get().parse::<u64>() {
            Ok(n) if n >= 1 => Some(n),
            _ => {
                return Err(invalid(
                    "max_output_tokens: must be an integer of at least 1",
                ));
            }
        },
        None => None,
    };
    let flag = |v: Option<&RawValue>, at: &str, default: bool| match given(v) {
        Some(v) => read::<bool>(v, at, "must be a boolean"),
        None => Ok(default),
    };
    let stream = flag(body.stream, "stream", false)?;
    let store = flag(body.store, "store", true)?;
    let previous_response_id: Option<String> = given(body.previous_response_id)
        .map(|id| read(id, "previous_response_id", "must be a string"))
        .transpose()?;
    for (name, value) in [("temperature", body.temperature), ("top_p", body.top_p)] {
        if let Some(v) = given(value)
            && v.get().parse::<f64>().is_err()
        {
            return Err(invalid(format!("{name}: must be a number")));
        }
    }
    // The instructions lead this turn only; the stored context and the input follow.
    let mut turn: Vec<ChatMessage<'_>> = Vec::new();
    match given(body.input) {
        None => return Err(invalid("input: Field required")),
        Some(input) if input.get().starts_with('"') => {
            let text: Cow<'_, str> = read(input, "input", "must be a string or an array")?;
            turn.push(ChatMessage::text("user", text));
        }
        Some(input) => {
            let items: Vec<&RawValue> = read(input, "input", "must be a string or an array")?;
            for (i, item) in items.into_iter().enumerate() {
                translate_item(item, i, &mut turn)?;
            }
        }
    }
    if turn.is_empty() && context.is_none() {
        return Err(invalid("input: at least one item is required"));
    }
    let conversation_turn = serde_json::to_string(&turn).map_err(|err| invalid(err.to_string()))?;
    let conversation = join_arrays(context.unwrap_or("[]"), &conversation_turn);
    let stored: Vec<&RawValue> = match context {
        Some(context) => serde_json::from_str(context)
            .map_err(|_| invalid("previous_response_id: the stored conversation is unreadable"))?,
        None => Vec::new(),
    };
    let mut messages: Vec<Turn<'_>> = Vec::new();
    if let Some(instructions) = given(body.instructions) {
        let text: Cow<'_, str> = read(instructions, "instructions", "must be a string")?;
        if !text.is_empty() {
            messages.push(Turn::Message(ChatMessage::text("system", text)));
        }
    }
    messages.extend(stored.into_iter().map(Turn::Raw));
    messages.extend(turn.into_iter().map(Turn::Message));
    let tools = match given(body.tools) {
        Some(t) => translate_tools(t)?,
        None => Vec::new(),
    };
    let tool_choice = match given(body.tool_choice) {
        Some(c) => Some(translate_tool_choice(c, &tools)?),
        None => None,
    };
    let parallel_tool_calls = match given(body.parallel_tool_calls) {
        Some(v) => Some(read::<bool>(v, "parallel_tool_calls", "must be a boolean")?),
        None => None,
    };
    let response_format = match given(body.text) {
        Some(t) => translate_text_format(t)?,
        None => None,
    };
    let user: Option<Cow<'_, str>> = match given(body.user) {
        Some(u) => Some(read(u, "user", "must be a string")?),
        None => None,
    };
    let mut echo = Map::new();
    echo.insert("store".to_owned(), Value::Bool(store));
    for (name, value) in [
        ("metadata", body.metadata),
        ("previous_response_id", body.previous_response_id),
        ("max_output_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("parallel_tool_calls", body.parallel_tool_calls),
        ("tool_choice", body.tool_choice),
        ("prompt_cache_key", body.prompt_cache_key),
        ("user", body.user),
    ] {
        if let Some(v) = given(value) {
            let v: Value = read(v, name, "must be valid JSON")?;
            echo.insert(name.to_owned(), v);
        }
    }
    if let Some(metadata) = echo.get("metadata")
        && !metadata.is_object()
    {
        return Err(invalid("metadata: must be an object"));
    }
    let wants_tools =
        !tools.is_empty() && tool_choice.as_ref().is_none_or(|c| c.get() != "\"none\"");
    let chat = Chat {
        model: &model,
        messages,
        max_tokens,
        stop: None,
        temperature: given(body.temperature),
        top_p: given(body.top_p),
        top_k: None,
        user,
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice,
        parallel_tool_calls,
        response_format,
        stream: stream.then_some(true),
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
    };
    let session = crate::openai::session_of(body.prompt_cache_key, body.user);
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
            session,
        },
        chat: bytes::Bytes::from(written),
        store,
        previous_response_id,
        conversation,
        echo,
    })
}

/// Two JSON arrays' elements as one array.
pub(crate) fn join_arrays(first: &str, second: &str) -> String {
    let inner = |a: &str| -> String {
        let a = a.trim();
        a.strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or("")
            .trim()
            .to_owned()
    };
    let (a, b) = (inner(first), inner(second));
    match (a.is_empty(), b.is_empty()) {
        (true, _) => format!("[{b}]"),
        (_, true) => format!("[{a}]"),
        _ => format!("[{a},{b}]"),
    }
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default)]
    r#type: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
}

/// One input item into the turn's messages: a message, a function call (joined to the
/// assistant message before it), a function call's output; reasoning items are dropped
/// (no chat provider takes them back).
fn translate_item<'a>(
    raw: &'a RawValue,
    i: usize,
    turn: &mut Vec<ChatMessage<'a>>,
) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let item: Item<'a> = read(raw, &at, "must be an object")?;
    match item.r#type.as_deref().unwrap_or("message") {
        "message" => {
            let role = match item.role.as_deref() {
                Some("user") => "user",
                Some("assistant") => "assistant",
                Some("system" | "developer") => "system",
                Some(other) => {
                    return Err(invalid(format!(
                        "{at}.role: must be user, assistant, system or developer, not {other:?}"
                    )));
                }
                None => return Err(invalid(format!("{at}.role: Field required"))),
            };
            let Some(content) = given(item.content) else {
                return Err(invalid(format!("{at}.content: Field required")));
            };
            let content = translate_content(content, &at)?;
            turn.push(ChatMessage {
                role,
                content,
                tool_calls: Vec::new(),
                tool_call_id: None,
            });
        }
        "function_call" => {
            let (Some(call_id), Some(name)) = (item.call_id, item.name) else {
                return Err(invalid(format!(
                    "{at}: a function_call needs call_id and name"
                )));
            };
            let call = ChatCall {
                id: call_id,
                r#type: "function",
                function: ChatFunction {
                    name,
                    arguments: item.arguments.unwrap_or(Cow::Borrowed("{}")),
                },
            };
            match turn.last_mut() {
                Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                _ => turn.push(ChatMessage {
                    role: "assistant",
                    content: None,
                    tool_calls: vec![call],
                    tool_call_id: None,
                }),
            }
        }
        "function_call_output" => {
            let Some(call_id) = item.call_id else {
                return Err(invalid(format!("{at}.call_id: Field required")));
            };
            let Some(output) = given(item.output) else {
                return Err(invalid(format!("{at}.output: Field required")));
            };
            let content = translate_content(output, &format!("{at}.output"))?
                .unwrap_or(Content::Text(Cow::Borrowed("")));
            turn.push(ChatMessage {
                role: "tool",
                content: Some(content),
                tool_calls: Vec::new(),
                tool_call_id: Some(call_id),
            });
        }
        "reasoning" => {}
        "item_reference" => {
            return Err(unsupported(format!(
                "{at}: items by reference are not supported; send the item itself, or use previous_response_id"
            )));
        }
        other => {
            return Err(invalid(format!(
                "{at}.type: unknown input item type {other:?}"
            )));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct PartIn<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
    #[serde(default)]
    image_url: Option<String>,
    #[serde(default)]
    file_id: Option<String>,
    #[serde(default)]
    file_data: Option<String>,
    #[serde(default)]
    filename: Option<String>,
}

/// A message's content (a string, or an array of parts) as chat content.
fn translate_content<'a>(raw: &'a RawValue, at: &str) -> Result<Option<Content<'a>>, ApiError> {
    if raw.get().starts_with('"') {
        let text: Cow<'a, str> = read(raw, &format!("{at}.content"), "must be a string")?;
        return Ok(Some(Content::Text(text)));
    }
    let parts: Vec<PartIn<'a>> = read(
        raw,
        &format!("{at}.content"),
        "must be a string or an array of content parts",
    )?;
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        out.push(match part.r#type.as_ref() {
            "input_text" | "output_text" | "text" => Part::Text {
                text: part
                    .text
                    .ok_or_else(|| invalid(format!("{at}.text: Field required")))?,
            },
            "refusal" => Part::Text {
                text: part.refusal.unwrap_or_default(),
            },
            "input_image" => match (part.image_url, part.file_id) {
                (Some(url), _) => Part::Image {
                    image_url: Url { url },
                },
                (None, Some(_)) => {
                    return Err(unsupported(format!(
                        "{at}.file_id: uploaded files are not supported; send image_url"
                    )));
                }
                (None, None) => {
                    return Err(invalid(format!("{at}.image_url: Field required")));
                }
            },
            "input_file" => match part.file_data {
                Some(file_data) => Part::File {
                    file: FileData {
                        file_data,
                        filename: part.filename,
                    },
                },
                None => {
                    return Err(unsupported(format!(
                        "{at}: only input_file with file_data is supported"
                    )));
                }
            },
            other => {
                return Err(invalid(format!(
                    "{at}.type: unknown content part type {other:?}"
                )));
            }
        });
    }
    Ok(Content::of(out))
}

#[derive(Deserialize)]
struct ToolIn<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    description: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
    #[serde(default)]
    strict: Option<bool>,
}

/// The schema of a function tool that gives none: any object.
static ANY_OBJECT: LazyLock<Box<RawValue>> = LazyLock::new(|| {
    RawValue::from_string(r#"{"type":"object","properties":{}}"#.to_owned())
        .unwrap_or_else(|_| unreachable!("a constant JSON object"))
});

fn translate_tools(raw: &RawValue) -> Result<Vec<ChatTool<'_>>, ApiError> {
    let tools: Vec<ToolIn<'_>> = read(raw, "tools", "must be an array of tools")?;
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        match tool.r#type.as_ref() {
            "function" => {}
            "custom" => {
                return Err(unsupported(format!(
                    "{at}: custom (freeform) tools are not supported by this model's providers; declare a function tool"
                )));
            }
            other => {
                return Err(unsupported(format!(
                    "{at}: the built-in tool {other:?} is not supported; declare a function tool"
                )));
            }
        }
        let name = tool
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid(format!("{at}.name: Field required")))?;
        let parameters = match given(tool.parameters) {
            Some(p) if p.get().starts_with('{') => p,
            Some(_) => return Err(invalid(format!("{at}.parameters: must be an object"))),
            None => &ANY_OBJECT,
        };
        out.push(ChatTool {
            r#type: "function",
            function: ToolFunction {
                name,
                description: tool.description,
                parameters,
                strict: tool.strict,
            },
        });
    }
    Ok(out)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ChoiceIn<'a> {
    Mode(Cow<'a, str>),
    Named {
        #[serde(borrow)]
        r#type: Cow<'a, str>,
        #[serde(borrow, default)]
        name: Option<Cow<'a, str>>,
    },
}

fn translate_tool_choice(
    raw: &RawValue,
    tools: &[ChatTool<'_>],
) -> Result<Box<RawValue>, ApiError> {
    let choice: ChoiceIn<'_> = read(
        raw,
        "tool_choice",
        "must be auto, none, required or a function",
    )?;
    let written = match choice {
        ChoiceIn::Mode(mode) if matches!(mode.as_ref(), "auto" | "none" | "required") => {
            format!("\"{mode}\"")
        }
        ChoiceIn::Named {
            r#type,
            name: Some(name),
        } if r#type == "function" => {
            if !tools.iter().any(|t| t.function.name == name) {
                return Err(invalid(format!(
                    "tool_choice.name: no function named {name:?} among tools"
                )));
            }
            serde_json::to_string(
                &serde_json::json!({"type": "function", "function": {"name": name}}),
            )
            .map_err(|err| invalid(err.to_string()))?
        }
        _ => {
            return Err(unsupported(
                "tool_choice: must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
            ));
        }
    };
    RawValue::from_string(written).map_err(|err| invalid(err.to_string()))
}

#[derive(Deserialize)]
struct TextIn<'a> {
    #[serde(borrow, default)]
    format: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct FormatIn<'a> {
    #[serde(borrow)]
    r#type: Cow<'a, str>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    schema: Option<&'a RawValue>,
    #[serde(default)]
    strict: Option<bool>,
}

/// `text.format` as chat's `response_format`: `json_schema` and `json_object` passed to
/// the provider, `text` (the default) as nothing.
fn translate_text_format(raw: &RawValue) -> Result<Option<Box<RawValue>>, ApiError> {
    let text: TextIn<'_> = read(raw, "text", "must be an object")?;
    let Some(format) = given(text.format) else {
        return Ok(None);
    };
    let format: FormatIn<'_> = read(format, "text.format", "must be an object with a type")?;
    let written = match format.r#type.as_ref() {
        "text" => return Ok(None),
        "json_object" => r#"{"type":"json_object"}"#.to_owned(),
        "json_schema" => {
            let name = format.name.unwrap_or(Cow::Borrowed("response"));
            let Some(schema) = given(format.schema) else {
                return Err(invalid("text.format.schema: Field required"));
            };
            let mut schema_json = serde_json::json!({"name": name});
            schema_json["schema"] =
                read::<Value>(schema, "text.format.schema", "must be an object")?;
            if let Some(strict) = format.strict {
                schema_json["strict"] = Value::Bool(strict);
            }
            serde_json::to_string(
                &serde_json::json!({"type": "json_schema", "json_schema": schema_json}),
            )
            .map_err(|err| invalid(err.to_string()))?
        }
        other => {
            return Err(invalid(format!(
                "text.format.type: must be text, json_object or json_schema, not {other:?}"
            )));
        }
    };
    RawValue::from_string(written)
        .map(Some)
        .map_err(|err| invalid(err.to_string()))
}
