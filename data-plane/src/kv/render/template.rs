//! A model's Hugging Face chat template, compiled once per loaded artifact set and rendered for
//! each request the way dynamo.frontend 1.6.1 renders it (dynamo-renderer 8.0.3): minijinja with
//! `trim_blocks` and `lstrip_blocks`, Python string methods, HF's `tojson` (Python separators, no
//! HTML escaping), `fromjson`, a `length` that counts none as 0, `raise_exception` and
//! `strftime_now`. There is no loader, so a template can neither include nor import anything,
//! and every render runs on a fuel budget and an output cap.

use std::io;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

/// minijinja instructions one render may execute (the seed's 5,000,000).
pub const RENDER_FUEL: u64 = 5_000_000;
/// Bytes of rendered text one render may produce.
pub const MAX_RENDERED_BYTES: usize = 1 << 20;

/// A compiled chat template and the special-token strings its context carries.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    unk_token: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("tokenizer_config.json is not a JSON object")]
    NotAnObject,
    #[error("no chat template: tokenizer_config.json has no chat_template and the card names no chat_template_file")]
    Missing,
    #[error("tokenizer_config.json's chat_template list has no template named \"default\"")]
    NoDefault,
    #[error("the chat template does not compile: {0}")]
    Compile(#[source] Error),
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("the rendered prompt exceeds {MAX_RENDERED_BYTES} bytes")]
    TooLarge,
    #[error("the chat template ran out of its {RENDER_FUEL} instruction budget")]
    OutOfFuel,
    #[error("the request has no messages array")]
    NoMessages,
    #[error("the chat template failed: {0}")]
    Template(#[source] Error),
}

impl ChatTemplate {
    /// `chat_template_file`, when the card names one, replaces the config's `chat_template`.
    pub fn new(tokenizer_config: &Json, chat_template_file: Option<&str>) -> Result<Self, TemplateError> {
        let config = tokenizer_config.as_object().ok_or(TemplateError::NotAnObject)?;
        let source = match chat_template_file {
            Some(source) => source.to_string(),
            None => config_template(config.get("chat_template"))?,
        };
        let mut env = environment();
        env.add_template_owned("default", strip_generation_tags(&source)).map_err(TemplateError::Compile)?;
        Ok(Self {
            env,
            bos_token: special_token(config.get("bos_token")),
            eos_token: special_token(config.get("eos_token")),
            unk_token: special_token(config.get("unk_token")),
        })
    }

    /// Renders an OpenAI chat-completions body, stopping at [`MAX_RENDERED_BYTES`].
    pub fn render(&self, request: &Json) -> Result<String, RenderError> {
        let context = self.context(request)?;
        let template = self.env.get_template("default").map_err(RenderError::Template)?;
        let mut out = CappedWriter { buf: Vec::new(), overflowed: false };
        match template.render_captured_to(context, &mut out) {
            Ok(_) => String::from_utf8(out.buf).map_err(|_| RenderError::Template(Error::from(ErrorKind::BadEscape))),
            Err(_) if out.overflowed => Err(RenderError::TooLarge),
            Err(error) if error.kind() == ErrorKind::OutOfFuel => Err(RenderError::OutOfFuel),
            Err(error) => Err(RenderError::Template(error)),
        }
    }

    fn context(&self, request: &Json) -> Result<Value, RenderError> {
        let messages = request.get("messages").filter(|m| m.is_array()).ok_or(RenderError::NoMessages)?;
        let mut context = serde_json::Map::new();
        context.insert("messages".into(), join_text_parts(messages));
        context.insert("tools".into(), tools(request));
        context.insert("bos_token".into(), self.bos_token.clone().map_or(Json::Null, Json::String));
        context.insert("eos_token".into(), self.eos_token.clone().map_or(Json::Null, Json::String));
        context.insert("unk_token".into(), self.unk_token.clone().map_or(Json::Null, Json::String));
        context.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt(request)));
        // Dynamo merges chat_template_args last, so they override everything above.
        if let Some(Json::Object(args)) =
            request.get("chat_template_args").or_else(|| request.get("chat_template_kwargs"))
        {
            context.extend(args.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        Ok(Value::from(Serde(&context)))
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // Both options are plain booleans, so the builder cannot fail; keep the default otherwise.
    if let Ok(syntax) = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build() {
        env.set_syntax(syntax);
    }
    env.set_fuel(Some(RENDER_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter(
        "length",
        |value: Value| if value.is_undefined() || value.is_none() { 0 } else { value.len().unwrap_or(0) },
    );
    env.add_filter("tojson", tojson);
    env.add_filter("fromjson", fromjson);
    env.add_filter("from_json", fromjson);
    env.add_function("raise_exception", |message: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", strftime_now);
    env
}

/// `chat_template` is a string, or HF's list of `{name, template}` of which "default" is used.
fn config_template(value: Option<&Json>) -> Result<String, TemplateError> {
    match value {
        Some(Json::String(source)) => Ok(source.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Json::as_str))
            .map(str::to_string)
            .ok_or(TemplateError::NoDefault),
        _ => Err(TemplateError::Missing),
    }
}

/// `bos_token` and friends are a string or an added-token object `{content: ..}`.
fn special_token(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(token) => Some(token.clone()),
        Json::Object(token) => token.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// vLLM's `{% generation %}` markers produce no output and are not Jinja; Dynamo drops them.
fn strip_generation_tags(source: &str) -> String {
    source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
}

/// Dynamo's rule: `add_generation_prompt` from the body (default true), false whenever
/// `continue_final_message` is true.
fn add_generation_prompt(request: &Json) -> bool {
    if request.get("continue_final_message").and_then(Json::as_bool) == Some(true) {
        return false;
    }
    request.get("add_generation_prompt").and_then(Json::as_bool).unwrap_or(true)
}

/// A content array of text parts only becomes their texts joined by newlines, as Dynamo does
/// for templates that expect string content.
fn join_text_parts(messages: &Json) -> Json {
    let mut messages = messages.clone();
    for message in messages.as_array_mut().into_iter().flatten() {
        let Some(content) = message.get_mut("content") else { continue };
        let Some(parts) = content.as_array() else { continue };
        let text_only = !parts.is_empty() && parts.iter().all(|p| p.get("type").and_then(Json::as_str) == Some("text"));
        if text_only {
            let texts: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect();
            *content = Json::String(texts.join("\n"));
        }
    }
    messages
}

/// `tools` as Dynamo hands them to the template: absent when the body has none or says
/// `tool_choice: "none"`, and each function's `parameters` object given `type: object` and
/// `properties: {}` (after its own keys) when it lacks them. Keys keep the order the client
/// sent them in, as in Dynamo, whose JSON maps preserve insertion order: a template that
/// prints tools with `tojson` (Qwen, Llama 3, Mistral, Hermes) renders the same bytes, where
/// sorted keys would change the prompt's first block and cost every tools request its overlap.
fn tools(request: &Json) -> Json {
    let Some(Json::Array(tools)) = request.get("tools") else { return Json::Null };
    if request.get("tool_choice").and_then(Json::as_str) == Some("none") {
        return Json::Null;
    }
    let mut tools = tools.clone();
    for tool in &mut tools {
        let Some(Json::Object(parameters)) = tool.get_mut("function").and_then(|f| f.get_mut("parameters")) else {
            continue;
        };
        parameters.entry("type").or_insert_with(|| Json::String("object".into()));
        parameters.entry("properties").or_insert_with(|| Json::Object(serde_json::Map::new()));
    }
    Json::Array(tools)
}

/// The widest `tojson(indent=n)` rendered; chat templates use 2 or 4.
pub const MAX_TOJSON_INDENT: usize = 16;

/// HF transformers' `tojson`: `json.dumps(x, ensure_ascii=False)` with Python's `", "` and
/// `": "` separators (or `indent=n`), no HTML escaping. Written under the output cap: the
/// template's fuel is charged for a filter's result only after it returns.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    if indent.is_some_and(|n| n > MAX_TOJSON_INDENT) {
        let message = format!("tojson indent is at most {MAX_TOJSON_INDENT}");
        return Err(Error::new(ErrorKind::InvalidOperation, message));
    }
    let mut buf = CappedWriter { buf: Vec::new(), overflowed: false };
    let result = match indent {
        Some(n) => {
            let indent = b" ".repeat(n);
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut buf,
                serde_json::ser::PrettyFormatter::with_indent(&indent),
            ))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut buf, PythonJson)),
    };
    result.map_err(|e| Error::new(ErrorKind::BadSerialization, "cannot serialize to JSON").with_source(e))?;
    String::from_utf8(buf.buf)
        .map(Value::from_safe_string)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, "JSON is not UTF-8").with_source(e))
}

fn fromjson(value: Value) -> Result<Value, Error> {
    let Some(text) = value.as_str() else { return Ok(value) };
    serde_json::from_str::<Json>(text)
        .map(|parsed| Value::from(Serde(&parsed)))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "cannot parse JSON").with_source(e))
}

/// The UTC time in `format` (the router has no local time zone to speak of).
fn strftime_now(format: &str) -> Result<Value, Error> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Ok(Value::from_safe_string(super::strftime::format_utc(format, now.as_secs())))
}

/// serde_json's compact output with Python's separators.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Refuses output past [`MAX_RENDERED_BYTES`], so an adversarial template stops as soon as it
/// overflows instead of after building a huge string.
struct CappedWriter {
    buf: Vec<u8>,
    overflowed: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(io::Error::other("rendered prompt too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chatml() -> ChatTemplate {
        ChatTemplate::new(&crate::kv::tests::tinymodel_config(), None).unwrap()
    }

    #[test]
    fn tinymodel_chatml_renders_a_conversation() {
        let request = json!({"model": "tiny", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello world, the quick brown fox"},
        ]});
        assert_eq!(
            chatml().render(&request).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n\
             <|im_start|>user\nHello world, the quick brown fox<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn generation_prompt_follows_the_request() {
        let base = json!({"messages": [{"role": "user", "content": "hi"}]});
        let open = |patch: Json| {
            let mut request = base.clone();
            request.as_object_mut().unwrap().extend(patch.as_object().unwrap().clone());
            chatml().render(&request).unwrap().ends_with("<|im_start|>assistant\n")
        };
        assert!(open(json!({})));
        assert!(!open(json!({"add_generation_prompt": false})));
        assert!(!open(json!({"continue_final_message": true})));
    }

    #[test]
    fn text_parts_are_joined_with_newlines() {
        let request = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
        ]}]});
        assert!(chatml().render(&request).unwrap().contains("user\na\nb<|im_end|>"));
    }

    #[test]
    fn tojson_uses_python_separators_and_tools_are_fixed() {
        let config = json!({"chat_template": "{{ tools | tojson }}|{{ tools | length }}|{{ '<&>' | tojson }}"});
        let template = ChatTemplate::new(&config, None).unwrap();
        let request =
            json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
        assert_eq!(
            template.render(&request).unwrap(),
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]|1|"<&>""#
        );
        let none = json!({"messages": [], "tools": [], "tool_choice": "none"});
        assert_eq!(template.render(&none).unwrap(), "null|0|\"<&>\"");
    }

    #[test]
    fn special_tokens_come_from_strings_or_added_token_objects() {
        let config = json!({"chat_template": "{{ bos_token }}{{ eos_token }}{{ unk_token }}",
            "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>"});
        assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap(), "<s></s>None");
    }

    #[test]
    fn a_template_file_and_named_templates_are_used() {
        let config =
            json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap(), "D");
        assert_eq!(ChatTemplate::new(&config, Some("F")).unwrap().render(&json!({"messages": []})).unwrap(), "F");
        assert!(matches!(ChatTemplate::new(&json!({}), None), Err(TemplateError::Missing)));
    }

    #[test]
    fn raise_exception_and_errors_are_template_failures() {
        let config = json!({"chat_template": "{{ raise_exception('only user and assistant roles') }}"});
        let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap_err();
        assert!(matches!(error, RenderError::Template(_)), "{error}");
        assert!(error.to_string().contains("only user and assistant roles"));
    }

    #[test]
    fn a_looping_template_runs_out_of_fuel() {
        let config = json!({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"});
        let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap_err();
        assert!(matches!(error, RenderError::OutOfFuel), "{error}");
    }

    #[test]
    fn tojson_is_bounded_in_its_indent_and_its_output() {
        let render = |template: &str, messages: Json| {
            let template = ChatTemplate::new(&json!({"chat_template": template}), None).map_err(|e| e.to_string())?;
            template.render(&json!({"messages": messages})).map_err(|e| e.to_string())
        };
        let two = json!([{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]);
        let huge_indent = render("{{ messages | tojson(indent=100000000000) }}", two.clone());
        assert!(huge_indent.is_err(), "an indent past the bound is refused, not allocated");
        assert!(render("{{ messages | tojson(indent=4) }}", two).is_ok_and(|text| text.contains("\n    {")));
        let chunk = "x".repeat(64 * 1024);
        let big: Vec<Json> = (0..17).map(|_| json!({"role": "user", "content": chunk})).collect();
        assert!(
            render("{{ messages | tojson }}", Json::Array(big)).is_err(),
            "its output is capped as the prompt's is"
        );
    }

    #[test]
    fn output_past_one_mebibyte_is_refused() {
        let config = json!({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"});
        let chunk = "x".repeat(64 * 1024);
        let messages: Vec<Json> = (0..17).map(|_| json!({"role": "user", "content": chunk})).collect();
        let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": messages})).unwrap_err();
        assert!(matches!(error, RenderError::TooLarge), "{error}");
        let fits: Vec<Json> = (0..16).map(|_| json!({"role": "user", "content": chunk})).collect();
        assert_eq!(
            ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": fits})).unwrap().len(),
            1 << 20
        );
    }
}
