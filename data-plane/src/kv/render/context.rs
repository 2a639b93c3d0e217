//! The template context dynamo.frontend 1.6.1 builds from a chat-completions body, rewrite
//! for rewrite, so the replica renders the prompt the workers will actually see.
//!
//! The frontend deserializes the body into typed OpenAI messages (field order fixed per role,
//! unknown fields dropped, a null assistant `content` omitted), then rewrites them for the
//! template at hand: text-only content arrays joined, media parts turned into placeholders,
//! JSON-string tool-call arguments parsed, reasoning folded into `<think>` blocks for
//! templates that do not read it, system turns reshaped for strict templates. The rules
//! here were read from dynamo-renderer 8.0.3 and dynamo-llm 1.6.1 (the versions the 1.6.1
//! wheel links) and are checked against the real frontend's renders in
//! `tests/fixtures/dynamo-1.6.1/renders/`.

use serde_json::{Map, Value as Json, json};

pub use self::args::template_args;
use super::template::MAX_RENDERED_BYTES;
use crate::json_shape::Shape;

mod args;

/// What the frontend appends to the final message for `continue_final_message`, and cuts
/// the rendered prompt at.
pub const CONTINUE_FINAL_MESSAGE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A body the frontend refuses before it renders (a 400 there): nothing to hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the frontend refuses this request: {0}")]
pub struct Refused(pub &'static str);

/// How one template (`default`, or `tool_use` when the request has tools) was found to
/// treat message shapes, by probing it once when it is compiled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shapes {
    /// It prints string tool-call arguments itself (`arguments is string`): leave them.
    pub arguments_as_string: bool,
    /// Its source reads `reasoning_content`: do not fold reasoning into `content`.
    pub reads_reasoning: bool,
    /// It reads `reasoning_content` only as a string: join segment arrays.
    pub reasoning_as_string: bool,
    /// It refuses a system turn after the first message: demote those to user turns.
    pub demote_later_system: bool,
    /// It refuses two user turns in a row: merge them.
    pub merge_consecutive_users: bool,
}

/// How the template set takes message content, probed once at compile time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContentShape {
    /// It renders only content arrays: strings become one text part.
    pub arrays: bool,
    /// It concatenates content as a string: mixed arrays are flattened with this image
    /// placeholder (`{n}` numbers the images).
    pub image_placeholder: Option<&'static str>,
}

/// Fields each role keeps, in the order the frontend's typed messages serialize them.
fn role_fields(role: &str) -> Option<&'static [&'static str]> {
    Some(match role {
        "system" => &["content", "name", "tools"],
        "developer" | "user" | "function" => &["content", "name"],
        "assistant" => {
            &["content", "reasoning_content", "refusal", "name", "audio", "tool_calls", "function_call", "partial"]
        }
        "tool" => &["content", "tool_call_id"],
        _ => return None,
    })
}

/// The messages as the template sees them, for a template with `shapes` in a set with
/// `content`; `continue_final` marks the last message's text with the tag.
pub fn messages(request: &Json, shapes: Shapes, content: ContentShape, continue_final: bool) -> Result<Json, Refused> {
    let given = request.get("messages").and_then(Json::as_array).ok_or(Refused("no messages array"))?;
    let mut messages = given.iter().map(typed_message).collect::<Result<Vec<_>, _>>()?;
    if messages.iter().any(|m| m.get("partial").and_then(Json::as_bool) == Some(true)) {
        return Err(Refused("assistant partial mode"));
    }
    if messages
        .iter()
        .any(|m| m.get("tools").is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|t| !t.is_empty())))
    {
        return Err(Refused("message-level tools"));
    }
    if continue_final {
        append_continue_tag(&mut messages)?;
    }
    if shapes.demote_later_system {
        demote_later_system(&mut messages);
    }
    if shapes.merge_consecutive_users {
        messages = merge_consecutive_users(messages);
    }
    let mut parsed = 0;
    for message in &mut messages {
        fix_content(message, content);
        if !shapes.arguments_as_string {
            for call in message.get_mut("tool_calls").and_then(Json::as_array_mut).into_iter().flatten() {
                parse_arguments(call.get_mut("function"), &mut parsed)?;
            }
        }
        parse_arguments(message.get_mut("function_call"), &mut parsed)?;
        if !shapes.reads_reasoning {
            fold_reasoning(message);
        } else if shapes.reasoning_as_string {
            join_reasoning(message);
        }
    }
    Ok(Json::Array(messages))
}

/// One message as the frontend's typed message serializes it.
fn typed_message(message: &Json) -> Result<Json, Refused> {
    let given = message.as_object().ok_or(Refused("a message is not an object"))?;
    let role = given.get("role").and_then(Json::as_str).ok_or(Refused("a message has no role"))?;
    let fields = role_fields(role).ok_or(Refused("unknown message role"))?;
    let mut typed = Map::new();
    typed.insert("role".into(), Json::String(role.into()));
    for &field in fields {
        let value = match field {
            // The typed assistant message reads `reasoning` as an alias.
            "reasoning_content" => match (given.get("reasoning_content"), given.get("reasoning")) {
                (Some(_), Some(_)) => return Err(Refused("both reasoning and reasoning_content")),
                (value, None) | (None, value) => value,
            },
            _ => given.get(field),
        };
        let value = match value {
            // A function message's content is not optional in the typed message: null stays.
            None | Some(Json::Null) if role == "function" && field == "content" => {
                typed.insert(field.into(), Json::Null);
                continue;
            }
            None | Some(Json::Null) => {
                let required = match role {
                    "assistant" | "function" => false,
                    "tool" => matches!(field, "content" | "tool_call_id"),
                    _ => field == "content",
                };
                if required {
                    return Err(Refused("a required message field is missing or null"));
                }
                continue;
            }
            Some(value) => value,
        };
        let value = match field {
            "content" => typed_content(value)?,
            "tool_calls" => Json::Array(
                value
                    .as_array()
                    .ok_or(Refused("tool_calls is not an array"))?
                    .iter()
                    .map(typed_tool_call)
                    .collect::<Result<_, _>>()?,
            ),
            "function_call" => typed_function(value)?,
            "audio" => json!({"id": value.get("id").ok_or(Refused("assistant audio has no id"))?}),
            _ => value.clone(),
        };
        typed.insert(field.into(), value);
    }
    Ok(Json::Object(typed))
}

/// Content is a string or an array of typed parts.
fn typed_content(content: &Json) -> Result<Json, Refused> {
    let Some(parts) = content.as_array() else {
        return if content.is_string() {
            Ok(content.clone())
        } else {
            Err(Refused("content is not a string or array"))
        };
    };
    let typed = parts
        .iter()
        .map(|part| {
            let kind = part.get("type").and_then(Json::as_str).ok_or(Refused("a content part has no type"))?;
            match kind {
                "text" => {
                    let text = part.get("text").filter(|t| t.is_string()).ok_or(Refused("a text part has no text"))?;
                    Ok(json!({"type": "text", "text": text}))
                }
                // Turned into bare placeholders below whatever they carry.
                "image_url" | "video_url" | "audio_url" => Ok(part.clone()),
                "input_audio" => {
                    let audio = part.get("input_audio").ok_or(Refused("an input_audio part has no input_audio"))?;
                    let field = |name: &str| audio.get(name).cloned().ok_or(Refused("input_audio lacks data or format"));
                    Ok(json!({"type": "input_audio", "input_audio": {"data": field("data")?, "format": field("format")?}}))
                }
                "refusal" => {
                    let refusal = part.get("refusal").ok_or(Refused("a refusal part has no refusal"))?;
                    Ok(json!({"type": "refusal", "refusal": refusal}))
                }
                _ => Err(Refused("unknown content part type")),
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Json::Array(typed))
}

fn typed_tool_call(call: &Json) -> Result<Json, Refused> {
    let id = call.get("id").filter(|id| id.is_string()).ok_or(Refused("a tool call has no id"))?;
    let kind = call.get("type").cloned().unwrap_or_else(|| Json::String("function".into()));
    let function = typed_function(call.get("function").ok_or(Refused("a tool call has no function"))?)?;
    // The frontend validates tool calls' arguments (not a legacy function_call's): blank, or
    // a JSON object.
    if let Some(text) = function["arguments"].as_str()
        && !text.trim().is_empty()
        && !Shape::is_object(text)
    {
        return Err(Refused("tool call arguments are not a JSON object string"));
    }
    Ok(json!({"id": id, "type": kind, "function": function}))
}

/// `{name, arguments}`, arguments as the JSON string the frontend holds: an object sent
/// in their place is serialized.
fn typed_function(function: &Json) -> Result<Json, Refused> {
    let name = function.get("name").filter(|n| n.is_string()).ok_or(Refused("a function call has no name"))?;
    let arguments = match function.get("arguments") {
        Some(Json::String(text)) => text.clone(),
        Some(other) if !other.is_null() => other.to_string(),
        _ => return Err(Refused("a function call has no arguments")),
    };
    Ok(json!({"name": name, "arguments": arguments}))
}

/// Appends [`CONTINUE_FINAL_MESSAGE_TAG`] to the last message's text (its last non-empty
/// text part for an array).
fn append_continue_tag(messages: &mut [Json]) -> Result<(), Refused> {
    const NOT_FOUND: Refused = Refused("no final message text to continue");
    let content = messages.last_mut().and_then(|m| m.get_mut("content")).ok_or(NOT_FOUND)?;
    let text = match content {
        Json::String(text) if !text.is_empty() => text,
        Json::Array(parts) => parts
            .iter_mut()
            .rev()
            .filter_map(|part| match part.get_mut("text") {
                Some(Json::String(text)) if !text.is_empty() => Some(text),
                _ => None,
            })
            .next()
            .ok_or(NOT_FOUND)?,
        _ => return Err(NOT_FOUND),
    };
    text.push_str(CONTINUE_FINAL_MESSAGE_TAG);
    Ok(())
}

/// Cuts a prompt rendered with the continue tag where the final message's text ends.
pub fn cut_at_continue_tag(mut rendered: String) -> Result<String, Refused> {
    let name = CONTINUE_FINAL_MESSAGE_TAG.trim_end();
    let at = rendered.rfind(name).ok_or(Refused("the template dropped the final message"))?;
    // A template that trimmed the tag's space gets the text before it trimmed too.
    let end = if rendered[at..].starts_with(CONTINUE_FINAL_MESSAGE_TAG) { at } else { rendered[..at].trim_end().len() };
    rendered.truncate(end);
    Ok(rendered)
}

fn has_role(message: &Json, role: &str) -> bool {
    message.get("role").and_then(Json::as_str) == Some(role)
}

/// Leading system turns merge into the first; later ones become user turns in place (not
/// moved to the front, so a reminder that comes and goes does not change the prefix).
fn demote_later_system(messages: &mut Vec<Json>) {
    let leading = messages.iter().take_while(|m| has_role(m, "system")).count();
    if leading > 1 {
        for mut extra in messages.drain(1..leading).collect::<Vec<_>>() {
            let content = extra.get_mut("content").map(Json::take).unwrap_or(Json::Null);
            append_content(&mut messages[0], content);
        }
    }
    for message in messages.iter_mut().skip(1) {
        if has_role(message, "system") {
            message["role"] = Json::String("user".into());
        }
    }
}

fn merge_consecutive_users(messages: Vec<Json>) -> Vec<Json> {
    let mut merged: Vec<Json> = Vec::with_capacity(messages.len());
    for mut message in messages {
        match merged.last_mut() {
            Some(previous) if has_role(previous, "user") && has_role(&message, "user") => {
                let content = message.get_mut("content").map(Json::take).unwrap_or(Json::Null);
                append_content(previous, content);
            }
            _ => merged.push(message),
        }
    }
    merged
}

/// Joins `content` onto a message's: strings with a blank line, arrays part for part (a
/// string beside an array becomes a text part), so image parts survive.
fn append_content(target: &mut Json, content: Json) {
    let Some(target) = target.as_object_mut() else { return };
    let text_part = |text: String| json!({"type": "text", "text": text});
    // Taken in place, and put back there: the message's fields keep the typed order the
    // frontend's renders them in (a removal would move its last field into the gap).
    let merged = match (target.get_mut("content").map(Json::take).unwrap_or(Json::Null), content) {
        (Json::String(mut first), Json::String(second)) => {
            if !first.is_empty() && !second.is_empty() {
                first.push_str("\n\n");
            }
            first.push_str(&second);
            Json::String(first)
        }
        (Json::Array(mut first), Json::Array(second)) => {
            first.extend(second);
            Json::Array(first)
        }
        (Json::Array(mut first), Json::String(second)) => {
            if !second.is_empty() {
                first.push(text_part(second));
            }
            Json::Array(first)
        }
        (Json::String(first), Json::Array(second)) => {
            let mut parts = Vec::with_capacity(second.len() + 1);
            if !first.is_empty() {
                parts.push(text_part(first));
            }
            parts.extend(second);
            Json::Array(parts)
        }
        (Json::Null, second) => second,
        (first, _) => first,
    };
    target.insert("content".into(), merged);
}

/// Media parts become bare placeholders (`{"type": "image"}`); then, for a template that
/// takes strings, a text-only array is joined with newlines and a mixed one flattened with
/// the template's image placeholder when it has one; for an array-only template a string
/// becomes one text part. An empty array stays an array.
fn fix_content(message: &mut Json, shape: ContentShape) {
    let Some(content) = message.get_mut("content") else { return };
    match content {
        Json::String(_) if shape.arrays => {
            let text = content.take();
            *content = json!([{"type": "text", "text": text}]);
        }
        Json::Array(parts) => {
            for part in parts.iter_mut() {
                let placeholder = match part.get("type").and_then(Json::as_str) {
                    Some("image_url") => "image",
                    Some("video_url") => "video",
                    Some("audio_url") => "audio",
                    _ => continue,
                };
                *part = json!({"type": placeholder});
            }
            if shape.arrays || parts.is_empty() {
                return;
            }
            if parts.iter().all(|p| has_type(p, "text")) {
                let texts: Vec<&str> = parts.iter().filter_map(|p| p.get("text")?.as_str()).collect();
                *content = Json::String(texts.join("\n"));
            } else if let Some(placeholder) = shape.image_placeholder {
                *content = Json::String(flatten(parts, placeholder));
            }
        }
        _ => {}
    }
}

fn has_type(part: &Json, kind: &str) -> bool {
    part.get("type").and_then(Json::as_str) == Some(kind)
}

/// Text parts as they are, every other part the placeholder with `{n}` its 1-based number.
fn flatten(parts: &[Json], placeholder: &str) -> String {
    let mut out = String::new();
    let mut number = 1;
    for part in parts {
        match part.get("type").and_then(Json::as_str) {
            Some("text") => out.push_str(part.get("text").and_then(Json::as_str).unwrap_or_default()),
            Some(kind) if !kind.is_empty() => {
                out.push_str(&placeholder.replace("{n}", &number.to_string()));
                number += 1;
            }
            _ => {}
        }
    }
    out
}

/// Arguments strings one render parses into values, at most. A value takes about forty
/// times its text ([`crate::json_shape`]); a template that prints more than this of them
/// would pass the rendered prompt's own cap anyway.
pub const MAX_PARSED_ARGUMENTS_BYTES: usize = MAX_RENDERED_BYTES;

/// Parses a function's (a tool call's, or a legacy `function_call`'s) JSON-string
/// `arguments` into the value it holds; a string that is not JSON stays a string. `parsed`
/// counts the text parsed so far, against [`MAX_PARSED_ARGUMENTS_BYTES`].
fn parse_arguments(function: Option<&mut Json>, parsed: &mut usize) -> Result<(), Refused> {
    let Some(arguments) = function.and_then(|f| f.get_mut("arguments")) else { return Ok(()) };
    let Some(text) = arguments.as_str() else { return Ok(()) };
    *parsed += text.len();
    if *parsed > MAX_PARSED_ARGUMENTS_BYTES {
        return Err(Refused("tool call arguments past 1 MiB"));
    }
    if let Ok(value) = serde_json::from_str::<Json>(text) {
        *arguments = value;
    }
    Ok(())
}

/// For a template that never reads `reasoning_content`: the reasoning goes into `content`
/// as `<think>…</think>` blocks ahead of the answer, as the model produced it.
fn fold_reasoning(message: &mut Json) {
    if !has_role(message, "assistant") {
        return;
    }
    let thought = match message.get("reasoning_content") {
        Some(Json::String(text)) if !text.is_empty() => format!("<think>{text}</think>"),
        Some(Json::Array(segments)) => {
            let thought: String = segments
                .iter()
                .filter_map(Json::as_str)
                .filter(|s| !s.is_empty())
                .map(|s| format!("<think>{s}</think>"))
                .collect();
            if thought.is_empty() {
                return;
            }
            thought
        }
        _ => return,
    };
    let content = match message.get_mut("content") {
        Some(Json::String(text)) => Json::String(format!("{thought}{text}")),
        None | Some(Json::Null) => Json::String(thought),
        Some(Json::Array(parts)) => {
            parts.insert(0, json!({"type": "text", "text": thought}));
            Json::Array(std::mem::take(parts))
        }
        Some(_) => return,
    };
    if let Some(message) = message.as_object_mut() {
        message.insert("content".into(), content);
        // Shifted out, not swapped: the fields after it keep their order.
        message.shift_remove("reasoning_content");
    }
}

/// Reasoning segments joined by newlines, for a template that reads only a string.
fn join_reasoning(message: &mut Json) {
    if !has_role(message, "assistant") {
        return;
    }
    if let Some(reasoning) = message.get_mut("reasoning_content")
        && let Some(segments) = reasoning.as_array()
    {
        let joined: Vec<&str> = segments.iter().filter_map(Json::as_str).filter(|s| !s.is_empty()).collect();
        *reasoning = Json::String(joined.join("\n"));
    }
}

/// `tools` as the frontend hands them to the template: none when the body has none or says
/// `tool_choice: "none"` (unless the card keeps them then); else each typed as `{type,
/// function: {name, description, parameters, strict}}`, a missing or non-string `description`
/// set to "", and an object `parameters` given `type: object` and `properties: {}` (after its
/// own keys) if it lacks them.
pub fn tools(request: &Json, keep_when_choice_none: bool) -> Json {
    match given_tools(request, keep_when_choice_none) {
        Some(Json::Array(tools)) => Json::Array(tools.iter().map(typed_tool).collect()),
        _ => Json::Null,
    }
}

/// The body's `tools` array as [`tools`] takes it, before typing: `None` when it hands the
/// template none.
pub fn given_tools(request: &Json, keep_when_choice_none: bool) -> Option<&Json> {
    let tools = request.get("tools").filter(|tools| tools.is_array())?;
    let choice_none = request.get("tool_choice").and_then(Json::as_str) == Some("none");
    (keep_when_choice_none || !choice_none).then_some(tools)
}

fn typed_tool(tool: &Json) -> Json {
    let Some(given) = tool.get("function").and_then(Json::as_object) else { return tool.clone() };
    let mut function = Map::new();
    for field in ["name", "description", "parameters", "strict"] {
        if let Some(value) = given.get(field).filter(|v| !v.is_null()) {
            function.insert(field.into(), value.clone());
        }
    }
    if !function.get("description").is_some_and(Json::is_string) {
        function.insert("description".into(), Json::String(String::new()));
    }
    if let Some(Json::Object(parameters)) = function.get_mut("parameters") {
        parameters.entry("type").or_insert_with(|| Json::String("object".into()));
        parameters.entry("properties").or_insert_with(|| Json::Object(Map::new()));
    }
    let kind = tool.get("type").cloned().unwrap_or_else(|| Json::String("function".into()));
    json!({"type": kind, "function": function})
}

/// Whether the request's tools select the `tool_use` template.
pub fn has_tools(tools: &Json) -> bool {
    tools.as_array().is_some_and(|tools| !tools.is_empty())
}

/// Dynamo's rule: `add_generation_prompt` from the body (default true), false with
/// `continue_final_message`, which refuses an explicit or defaulted true beside it.
pub fn generation_prompt(request: &Json) -> Result<(bool, bool), Refused> {
    let continue_final = request.get("continue_final_message").and_then(Json::as_bool) == Some(true);
    let add = request.get("add_generation_prompt").and_then(Json::as_bool);
    if continue_final && add != Some(false) {
        return Err(Refused("continue_final_message with add_generation_prompt"));
    }
    Ok((add.unwrap_or(true) && !continue_final, continue_final))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shaped(messages: Json, shapes: Shapes, content: ContentShape) -> Json {
        super::messages(&json!({"messages": messages}), shapes, content, false).unwrap()
    }

    #[test]
    fn messages_take_their_typed_shape() {
        let out = shaped(
            json!([
                {"content": "hi", "role": "user", "extra": 1},
                {"tool_calls": [{"function": {"arguments": "{\"q\": 1}", "name": "f"}, "id": "c"}], "reasoning": "r", "content": null, "role": "assistant"},
                {"name": "f", "content": "res", "tool_call_id": "c", "role": "tool"},
            ]),
            Shapes { reads_reasoning: true, ..Shapes::default() },
            ContentShape::default(),
        );
        assert_eq!(
            serde_json::to_string(&out).unwrap(),
            r#"[{"role":"user","content":"hi"},{"role":"assistant","reasoning_content":"r","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":{"q":1}}}]},{"role":"tool","content":"res","tool_call_id":"c"}]"#
        );
    }

    #[test]
    fn refusals_match_the_frontends_validation() {
        let refused = |messages: Json| {
            super::messages(&json!({"messages": messages}), Shapes::default(), ContentShape::default(), false)
        };
        assert!(refused(json!([{"role": "user", "content": null}])).is_err());
        assert!(refused(json!([{"role": "wizard", "content": "x"}])).is_err());
        let call = |arguments: &str| json!([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]}]);
        assert!(refused(call("[1, 2]")).is_err());
        assert!(refused(call("not json")).is_err());
        assert!(refused(call("")).is_ok());
        assert!(refused(call(" \n")).is_ok());
        let legacy = json!([{"role": "assistant", "function_call": {"name": "f", "arguments": "not json"}}]);
        assert!(refused(legacy).is_ok(), "a legacy function_call's arguments are not validated");
        // Parsed into values (forty times their text) only up to a bound, across the messages.
        let half = format!("{{\"a\":\"{}\"}}", "x".repeat(MAX_PARSED_ARGUMENTS_BYTES / 2));
        let one = refused(call(&half)).unwrap();
        assert!(one[0]["tool_calls"][0]["function"]["arguments"].is_object(), "parsed");
        let calls = json!([call(&half)[0].clone(), call(&half)[0].clone()]);
        assert!(refused(calls).is_err(), "past {MAX_PARSED_ARGUMENTS_BYTES} bytes of arguments");
        assert!(refused(json!([{"role": "assistant", "content": "x", "partial": true}])).is_err());
    }

    /// A merged or folded message keeps its fields in the order the frontend's typed message
    /// has them: a template printing whole messages (`message|tojson`) renders the same bytes.
    #[test]
    fn merging_and_folding_keep_the_fields_in_their_typed_order() {
        let merge = Shapes { merge_consecutive_users: true, ..Shapes::default() };
        let users =
            json!([{"role": "user", "content": "a", "name": "n"}, {"role": "user", "content": "b", "name": "n"}]);
        let one = shaped(json!([{"role": "user", "content": "a", "name": "n"}]), merge, ContentShape::default());
        let merged = shaped(users, merge, ContentShape::default());
        let keys = |message: &Json| message.as_object().map(|m| m.keys().cloned().collect::<Vec<_>>());
        assert_eq!(keys(&merged[0]), keys(&one[0]), "{merged}");
        assert_eq!(merged[0]["content"], "a\n\nb");
        let turn = json!([{"role": "assistant", "content": "x", "reasoning_content": "why", "name": "n",
                           "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]);
        let folded = shaped(turn.clone(), Shapes::default(), ContentShape::default());
        let kept = shaped(turn, Shapes { reads_reasoning: true, ..Shapes::default() }, ContentShape::default());
        let without_reasoning = |message: &Json| {
            keys(message).map(|k| k.into_iter().filter(|k| k != "reasoning_content").collect::<Vec<_>>())
        };
        assert_eq!(keys(&folded[0]), without_reasoning(&kept[0]), "{folded}");
    }

    #[test]
    fn reasoning_is_folded_for_templates_that_do_not_read_it() {
        let turn = json!([{"role": "assistant", "content": "answer", "reasoning_content": "why"}]);
        let folded = shaped(turn.clone(), Shapes::default(), ContentShape::default());
        assert_eq!(folded, json!([{"role": "assistant", "content": "<think>why</think>answer"}]));
        let kept = shaped(turn, Shapes { reads_reasoning: true, ..Shapes::default() }, ContentShape::default());
        assert_eq!(kept[0]["reasoning_content"], "why");
        let segments = json!([{"role": "assistant", "reasoning_content": ["a", "", "b"]}]);
        let joined = shaped(
            segments,
            Shapes { reads_reasoning: true, reasoning_as_string: true, ..Shapes::default() },
            ContentShape::default(),
        );
        assert_eq!(joined[0]["reasoning_content"], "a\nb");
    }

    #[test]
    fn content_follows_the_templates_shape() {
        let mixed = json!([{"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "u"}}]}]);
        assert_eq!(
            shaped(mixed.clone(), Shapes::default(), ContentShape::default())[0]["content"],
            json!([{"type": "text", "text": "see "}, {"type": "image"}])
        );
        let phi = ContentShape { arrays: false, image_placeholder: Some("<|image_{n}|>") };
        assert_eq!(shaped(mixed, Shapes::default(), phi)[0]["content"], "see <|image_1|>");
        let arrays = ContentShape { arrays: true, image_placeholder: None };
        assert_eq!(
            shaped(json!([{"role": "user", "content": "hi"}]), Shapes::default(), arrays)[0]["content"],
            json!([{"type": "text", "text": "hi"}])
        );
    }

    #[test]
    fn strict_templates_get_system_turns_reshaped() {
        let messages = json!([
            {"role": "system", "content": "a"}, {"role": "system", "content": "b"},
            {"role": "user", "content": "u1"}, {"role": "system", "content": "note"}, {"role": "user", "content": "u2"},
        ]);
        let both = Shapes { demote_later_system: true, merge_consecutive_users: true, ..Shapes::default() };
        assert_eq!(
            shaped(messages, both, ContentShape::default()),
            json!([{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "u1\n\nnote\n\nu2"}])
        );
    }

    #[test]
    fn the_continue_tag_marks_and_cuts_the_final_text() {
        let request = json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "par"}]});
        let marked = super::messages(&request, Shapes::default(), ContentShape::default(), true).unwrap();
        assert_eq!(marked[1]["content"], format!("par{CONTINUE_FINAL_MESSAGE_TAG}"));
        assert_eq!(cut_at_continue_tag(format!("<a>par{CONTINUE_FINAL_MESSAGE_TAG}</a>")).unwrap(), "<a>par");
        assert_eq!(cut_at_continue_tag("<a>par  CONTINUE_FINAL_MESSAGE_TAG</a>".into()).unwrap(), "<a>par");
        assert!(cut_at_continue_tag("<a>par</a>".into()).is_err());
        assert!(generation_prompt(&json!({"continue_final_message": true})).is_err());
        assert_eq!(
            generation_prompt(&json!({"continue_final_message": true, "add_generation_prompt": false})),
            Ok((false, true))
        );
    }

    #[test]
    fn tools_are_typed_and_fixed() {
        let request = json!({"tools": [
            {"function": {"parameters": {"properties": {}}, "name": "f", "extra": 1}, "type": "function"},
            {"type": "function", "function": {"name": "g", "description": null}},
        ]});
        assert_eq!(
            serde_json::to_string(&tools(&request, false)).unwrap(),
            r#"[{"type":"function","function":{"name":"f","parameters":{"properties":{},"type":"object"},"description":""}},{"type":"function","function":{"name":"g","description":""}}]"#
        );
        let choice_none = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"});
        assert!(tools(&choice_none, false).is_null(), "dropped, as Dynamo does by default");
        let kept = tools(&choice_none, true);
        assert_eq!(
            kept[0]["function"]["name"], "f",
            "kept for a card that sets exclude_tools_when_tool_choice_none: false"
        );
    }
}
