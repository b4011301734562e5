//! The OpenAI chat completions body a dialect's request is translated into: what a
//! normalized run reads as its input and a tunnel sends to the provider.

use std::borrow::Cow;

use serde::Serialize;
use serde_json::value::RawValue;

/// The chat completions body written.
#[derive(Serialize)]
pub(crate) struct Chat<'a> {
    pub(crate) model: &'a str,
    pub(crate) messages: Vec<Turn<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stop: Option<&'a Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) temperature: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) top_p: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) top_k: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) user: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tools: Option<Vec<ChatTool<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_choice: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) response_format: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stream_options: Option<StreamOptions>,
}

#[derive(Serialize)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: bool,
}

/// A message of the body: one translated now, or one kept as written (a stored
/// conversation's).
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum Turn<'a> {
    Message(ChatMessage<'a>),
    Raw(&'a RawValue),
}

#[derive(Serialize)]
pub(crate) struct ChatMessage<'a> {
    pub(crate) role: &'static str,
    /// `null` for an assistant turn of tool calls alone.
    pub(crate) content: Option<Content<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) tool_calls: Vec<ChatCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_call_id: Option<Cow<'a, str>>,
}

impl<'a> ChatMessage<'a> {
    pub(crate) fn text(role: &'static str, text: Cow<'a, str>) -> Self {
        ChatMessage {
            role,
            content: Some(Content::Text(text)),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A message's content: one text as a string (what every server and chat template takes),
/// anything else as parts.
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

impl<'a> Content<'a> {
    pub(crate) fn of(mut parts: Vec<Part<'a>>) -> Option<Self> {
        match parts.len() {
            0 => None,
            1 if matches!(parts[0], Part::Text { .. }) => match parts.pop() {
                Some(Part::Text { text }) => Some(Content::Text(text)),
                _ => None,
            },
            _ => Some(Content::Parts(parts)),
        }
    }
}

#[derive(Serialize)]
#[serde(tag = "type")]
pub(crate) enum Part<'a> {
    #[serde(rename = "text")]
    Text { text: Cow<'a, str> },
    #[serde(rename = "image_url")]
    Image { image_url: Url },
    #[serde(rename = "file")]
    File { file: FileData },
}

#[derive(Serialize)]
pub(crate) struct Url {
    pub(crate) url: String,
}

#[derive(Serialize)]
pub(crate) struct FileData {
    pub(crate) file_data: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) filename: Option<String>,
}

#[derive(Serialize)]
pub(crate) struct ChatCall<'a> {
    pub(crate) id: Cow<'a, str>,
    pub(crate) r#type: &'static str,
    pub(crate) function: ChatFunction<'a>,
}

#[derive(Serialize)]
pub(crate) struct ChatFunction<'a> {
    pub(crate) name: Cow<'a, str>,
    /// The input object as JSON text, as OpenAI writes arguments.
    pub(crate) arguments: Cow<'a, str>,
}

#[derive(Serialize)]
pub(crate) struct ChatTool<'a> {
    pub(crate) r#type: &'static str,
    pub(crate) function: ToolFunction<'a>,
}

#[derive(Serialize)]
pub(crate) struct ToolFunction<'a> {
    pub(crate) name: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) description: Option<Cow<'a, str>>,
    pub(crate) parameters: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) strict: Option<bool>,
}
