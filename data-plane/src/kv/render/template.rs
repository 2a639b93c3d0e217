//! A model's Hugging Face chat template, compiled once per loaded artifact set and rendered for
//! each request the way dynamo.frontend 1.6.1 renders it: its template engine (minijinja
//! 2.24 with `trim_blocks` and `lstrip_blocks`), its Python spellings ([`super::python`]),
//! HF's `tojson`, `fromjson`, a `length` that counts none as 0, `raise_exception` and
//! `strftime_now`, its source rewrites, and the context it builds ([`super::context`]),
//! shaped by what the template was found to accept when it was compiled. There is no loader,
//! so a template can neither include nor import anything, and every render runs on a fuel
//! budget and an output cap.

use continuum_proto::model::PromptDefaults;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json, json};

use super::context::{self, ContentShape, Refused, Shapes};
use super::python::{self, CappedWriter};

/// minijinja instructions one render may execute (the seed's 5,000,000).
pub const RENDER_FUEL: u64 = 5_000_000;
/// Instructions each compile-time probe may execute: a probe renders a three-message
/// conversation, thousands of instructions for any real template, and the up to 18 of them
/// (shape probes on the default and tool-use templates, content probes) together cost a
/// template that loops less than two requests' renders, once per load.
const PROBE_FUEL: u64 = RENDER_FUEL / 10;
/// Bytes of rendered text one render may produce.
pub const MAX_RENDERED_BYTES: usize = 1 << 20;
/// What a render's context may weigh times its longest list or object (its messages, tools or
/// documents, or a tool's parameters looped over with `|items`). A template that builds a string one item at a time (DeepSeek's joins every
/// system message into one) copies the string so far at each step, about half this product in
/// all, and neither fuel (counted per
/// instruction, not per byte) nor the output cap (checked when the string is printed, after
/// the loop) stops it: 140,000 short messages in an 8 MiB body would copy for tens of
/// seconds. At this bound a render copies at most about 2 GiB, while a 1,000-message
/// conversation of 1 MiB still renders.
const MAX_ACCUMULATION: u64 = 1 << 32;
/// What each JSON value in the context weighs besides its strings' bytes: a template joining
/// even empty messages copies its separators.
const VALUE_WEIGHT: u64 = 16;

/// The template a request with tools renders; a single-source template is both.
const TOOL_USE: &str = "tool_use";
const DEFAULT: &str = "default";

/// A compiled chat template, the special-token strings its context carries, and the message
/// shapes its probes found it to need.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    tokens: Tokens,
    default: Shapes,
    tool_use: Shapes,
    content: ContentShape,
}

#[derive(Debug, Clone, Default)]
struct Tokens {
    bos: Option<String>,
    eos: Option<String>,
    unk: Option<String>,
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
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error("the chat template failed: {0}")]
    Template(#[source] Error),
}

impl ChatTemplate {
    /// `chat_template_file`, when the card names one, replaces the config's `chat_template`.
    pub fn new(tokenizer_config: &Json, chat_template_file: Option<&str>) -> Result<Self, TemplateError> {
        let config = tokenizer_config.as_object().ok_or(TemplateError::NotAnObject)?;
        let sources = match chat_template_file {
            Some(source) => single_source(source),
            None => config_templates(config.get("chat_template"))?,
        };
        let mut env = environment();
        env.set_fuel(Some(PROBE_FUEL));
        for (name, source) in sources {
            env.add_template_owned(name, normalize_source(&source)).map_err(TemplateError::Compile)?;
        }
        let tokens = Tokens {
            bos: special_token(config.get("bos_token")),
            eos: special_token(config.get("eos_token")),
            unk: special_token(config.get("unk_token")),
        };
        let probe_tools = json!([{"type": "function", "function": {
            "name": "probe", "description": "", "parameters": {"type": "object", "properties": {}}}}]);
        let default = probe_shapes(&env, DEFAULT, &Json::Null, &tokens);
        let tool_use = probe_shapes(&env, TOOL_USE, &probe_tools, &tokens);
        let content = probe_content(&env);
        env.set_fuel(Some(RENDER_FUEL));
        Ok(Self { env, tokens, default, tool_use, content })
    }

    /// Renders an OpenAI chat-completions body, stopping at [`MAX_RENDERED_BYTES`], as for a card
    /// that sets no prompt defaults.
    pub fn render(&self, request: &Json) -> Result<String, RenderError> {
        self.render_with(request, PromptDefaults::default())
    }

    /// [`Self::render`] for a card whose `runtime_config` sets `defaults`.
    pub fn render_with(&self, request: &Json, defaults: PromptDefaults) -> Result<String, RenderError> {
        // What the context copies whole from the body (its tools, its template arguments) is
        // weighed there first: millions of values in them are refused before they are copied,
        // not after, outside the budget that bounds the body's tree.
        let tools = context::given_tools(request, defaults.keep_tools_when_tool_choice_none);
        let copied = [tools, request.get("chat_template_args"), request.get("chat_template_kwargs")];
        if accumulation(copied.into_iter().flatten()) > MAX_ACCUMULATION {
            return Err(RenderError::TooLarge);
        }
        let (add_generation_prompt, continue_final) = context::generation_prompt(request)?;
        let tools = context::tools(request, defaults.keep_tools_when_tool_choice_none);
        let (name, shapes) =
            if context::has_tools(&tools) { (TOOL_USE, self.tool_use) } else { (DEFAULT, self.default) };
        let messages = context::messages(request, shapes, self.content, continue_final)?;
        let args = context::template_args(request, defaults.default_thinking)?;
        let mut context = self.context(messages, tools, add_generation_prompt);
        // The frontend's own keys win over the request's template arguments.
        for (key, value) in args {
            context.entry(key).or_insert(value);
        }
        if accumulation(context.values()) > MAX_ACCUMULATION {
            return Err(RenderError::TooLarge);
        }
        let rendered = self.render_named(name, &context)?;
        if continue_final { Ok(context::cut_at_continue_tag(rendered)?) } else { Ok(rendered) }
    }

    fn context(&self, messages: Json, tools: Json, add_generation_prompt: bool) -> Map<String, Json> {
        let token = |t: &Option<String>| t.clone().map_or(Json::Null, Json::String);
        let mut context = Map::new();
        context.insert("messages".into(), messages);
        context.insert("tools".into(), tools);
        context.insert("bos_token".into(), token(&self.tokens.bos));
        context.insert("eos_token".into(), token(&self.tokens.eos));
        context.insert("unk_token".into(), token(&self.tokens.unk));
        context.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        context
    }

    fn render_named(&self, name: &str, context: &Map<String, Json>) -> Result<String, RenderError> {
        render_capped(&self.env, name, context)
    }
}

/// The weight of `values` (their strings' bytes, and [`VALUE_WEIGHT`] a value) times the length
/// of their longest list or object, at any depth (a message's content parts, a tool's
/// parameters, whose properties a template loops over with `|items`): the most steps a loop
/// over one of them takes.
fn accumulation<'a>(values: impl IntoIterator<Item = &'a Json>) -> u64 {
    /// Adds `value`'s weight to `weight` and raises `longest` to its longest list or object.
    fn walk(value: &Json, weight: &mut u64, longest: &mut usize) {
        *weight = weight.saturating_add(VALUE_WEIGHT);
        match value {
            Json::String(s) => *weight = weight.saturating_add(s.len() as u64),
            Json::Array(items) => {
                *longest = (*longest).max(items.len());
                items.iter().for_each(|item| walk(item, weight, longest));
            }
            Json::Object(map) => {
                *longest = (*longest).max(map.len());
                for (key, value) in map {
                    *weight = weight.saturating_add(key.len() as u64);
                    walk(value, weight, longest);
                }
            }
            Json::Null | Json::Bool(_) | Json::Number(_) => {}
        }
    }
    let (mut weight, mut longest) = (0u64, 0usize);
    values.into_iter().for_each(|value| walk(value, &mut weight, &mut longest));
    (longest.max(1) as u64).saturating_mul(weight)
}

/// Renders `name` under the prompt's output cap (and the environment's fuel).
fn render_capped(env: &Environment, name: &str, context: &impl serde::Serialize) -> Result<String, RenderError> {
    let template = env.get_template(name).map_err(RenderError::Template)?;
    let mut out = CappedWriter::new(MAX_RENDERED_BYTES);
    match template.render_captured_to(Value::from_serialize(context), &mut out) {
        Ok(_) => String::from_utf8(out.buf).map_err(|_| RenderError::Template(Error::from(ErrorKind::BadEscape))),
        Err(_) if out.overflowed => Err(RenderError::TooLarge),
        Err(error) if error.detail() == Some(python::TOJSON_TOO_LARGE) => Err(RenderError::TooLarge),
        Err(error) if error.kind() == ErrorKind::OutOfFuel => Err(RenderError::OutOfFuel),
        Err(error) => Err(RenderError::Template(error)),
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(RENDER_FUEL));
    env.set_unknown_method_callback(python::methods);
    env.set_formatter(python::formatter);
    env.add_filter(
        "length",
        |value: Value| if value.is_undefined() || value.is_none() { 0 } else { value.len().unwrap_or(0) },
    );
    env.add_filter("trim", python::trim_filter);
    env.add_filter("string", python::string_filter);
    env.add_filter("tojson", |value: Value, kwargs: Kwargs| python::tojson(value, kwargs, MAX_RENDERED_BYTES));
    env.add_filter("fromjson", fromjson);
    env.add_filter("from_json", fromjson);
    env.add_function("raise_exception", |message: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", strftime_now);
    env
}

/// `chat_template` is a string (both the default and the tool-use template), or HF's list of
/// `{name, template}`, which must name a "default".
fn config_templates(value: Option<&Json>) -> Result<Vec<(String, String)>, TemplateError> {
    match value {
        Some(Json::String(source)) => Ok(single_source(source)),
        Some(Json::Array(named)) => {
            let templates: Vec<(String, String)> = named
                .iter()
                .filter_map(|t| Some((t.get("name")?.as_str()?.to_string(), t.get("template")?.as_str()?.to_string())))
                .collect();
            if templates.iter().any(|(name, _)| name == DEFAULT) {
                Ok(templates)
            } else {
                Err(TemplateError::NoDefault)
            }
        }
        _ => Err(TemplateError::Missing),
    }
}

/// One source serves as both the default and the tool-use template.
fn single_source(source: &str) -> Vec<(String, String)> {
    vec![(DEFAULT.to_string(), source.to_string()), (TOOL_USE.to_string(), source.to_string())]
}

/// `bos_token` and friends are a string or an added-token object `{content: ..}`.
fn special_token(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(token) => Some(token.clone()),
        Json::Object(token) => token.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// The frontend's source rewrites: vLLM's `{% generation %}` markers become a `with` block
/// (same scope and whitespace, no output of their own), and `x.items()` in code becomes
/// `x|items`, since a JSON schema's `items` key would otherwise shadow the method. Comments,
/// raw blocks and string literals are left as written.
fn normalize_source(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        rest = &rest[open..];
        let close = match rest.as_bytes().get(1) {
            Some(b'#') => "#}",
            Some(b'{') => "}}",
            Some(b'%') => "%}",
            _ => {
                out.push('{');
                rest = &rest[1..];
                continue;
            }
        };
        let Some(end) = tag_end(rest, close) else {
            out.push_str(rest);
            return out;
        };
        let inner = &rest[2..end - 2];
        match close {
            "#}" => out.push_str(&rest[..end]),
            "}}" => {
                out.push_str("{{");
                out.push_str(&rewrite_items(inner));
                out.push_str("}}");
            }
            _ if block_name(inner) == "raw" => {
                let Some(raw_end) = raw_block_end(rest, end) else {
                    out.push_str(rest);
                    return out;
                };
                out.push_str(&rest[..raw_end]);
                rest = &rest[raw_end..];
                continue;
            }
            _ => {
                out.push_str("{%");
                match block_name(inner) {
                    "generation" => out.push_str(&inner.replacen("generation", "with", 1)),
                    "endgeneration" => out.push_str(&inner.replacen("endgeneration", "endwith", 1)),
                    _ => out.push_str(&rewrite_items(inner)),
                }
                out.push_str("%}");
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A tag's code without its whitespace-control marks.
fn block_name(inner: &str) -> &str {
    let code = inner.strip_prefix(['-', '+']).unwrap_or(inner);
    code.strip_suffix(['-', '+']).unwrap_or(code).trim()
}

/// Follows a template's code a character at a time to tell what lies inside a string
/// literal, quotes and escapes included.
#[derive(Default)]
struct Literals {
    quote: Option<char>,
    escaped: bool,
}

impl Literals {
    /// Takes the next character: whether it belongs to a string literal.
    fn inside(&mut self, c: char) -> bool {
        if let Some(delimiter) = self.quote {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == delimiter {
                self.quote = None;
            }
            return true;
        }
        if c == '\'' || c == '"' {
            self.quote = Some(c);
            return true;
        }
        false
    }
}

/// Where the tag opening `tag` ends (past `close`): string literals skipped, nested braces
/// counted.
fn tag_end(tag: &str, close: &str) -> Option<usize> {
    if close == "#}" {
        return tag[2..].find(close).map(|at| 2 + at + close.len());
    }
    let (mut literals, mut braces) = (Literals::default(), 0usize);
    for (at, c) in tag.char_indices().skip(2) {
        if literals.inside(c) {
            continue;
        }
        if braces == 0 && tag[at..].starts_with(close) {
            return Some(at + close.len());
        }
        match c {
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// Where `{% endraw %}` ends, searching from `from`: a raw block's text may hold unmatched
/// quotes and tag-shaped text, so only the closing tag itself is read (one pass).
fn raw_block_end(text: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(open) = text[at..].find("{%").map(|i| at + i) {
        let tag = &text[open + 2..];
        let code = tag.strip_prefix(['-', '+']).unwrap_or(tag).trim_start();
        if let Some(after) = code.strip_prefix("endraw") {
            let after = after.trim_start();
            let after = after.strip_prefix(['-', '+']).unwrap_or(after);
            if after.starts_with("%}") {
                return Some(text.len() - after.len() + 2);
            }
        }
        at = open + 2;
    }
    None
}

/// `.items()` outside string literals becomes `|items`.
fn rewrite_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut literals = Literals::default();
    let mut rest = code;
    while let Some(c) = rest.chars().next() {
        if !literals.inside(c)
            && let Some(after) = rest.strip_prefix(".items()")
        {
            out.push_str("|items");
            rest = after;
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Renders a probe conversation on `name` with the context the frontend's shape probes give
/// it; `None` when the template refuses it.
fn probe(
    env: &Environment,
    name: &str,
    messages: Json,
    tools: &Json,
    tokens: &Tokens,
    generation: bool,
) -> Option<String> {
    let context = json!({
        "messages": messages, "tools": tools, "add_generation_prompt": generation,
        "bos_token": tokens.bos, "eos_token": tokens.eos, "unk_token": tokens.unk,
    });
    probe_render(env, name, &context)
}

/// A probe's render; `None` when the template refuses it.
fn probe_render(env: &Environment, name: &str, context: &Json) -> Option<String> {
    render_capped(env, name, context).ok()
}

/// What one template does with the message shapes agent clients send, found as the
/// frontend finds it: by rendering small conversations once and watching what it refuses
/// or prints.
fn probe_shapes(env: &Environment, name: &str, tools: &Json, tokens: &Tokens) -> Shapes {
    let Ok(template) = env.get_template(name) else { return Shapes::default() };
    let source = template.source();
    let refuses = |messages: Json| probe(env, name, messages, tools, tokens, false).is_none();
    let turn = |role: &str, content: &str| json!({"role": role, "content": content});
    let (mut demote_later_system, mut merge_consecutive_users) = (false, false);
    if !refuses(json!([turn("system", "s"), turn("user", "u")])) {
        demote_later_system = refuses(json!([turn("system", "s0"), turn("user", "u"), turn("system", "s1")]))
            || refuses(json!([
                turn("system", "s0"),
                turn("user", "u"),
                turn("assistant", "a"),
                turn("system", "s1"),
                turn("user", "u2")
            ]));
        merge_consecutive_users = refuses(json!([turn("system", "s"), turn("user", "u0"), turn("user", "u1")]));
    }
    // A template that tests `arguments is string` prints a string itself, unless the test
    // only refuses strings: check that a string argument comes through.
    let tool_turn = |reasoning: Option<Json>, arguments: Json| {
        let mut assistant = json!({"role": "assistant", "content": ""});
        if let Some(reasoning) = reasoning {
            assistant["reasoning_content"] = reasoning;
        }
        assistant["tool_calls"] =
            json!([{"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": arguments}}]);
        json!([{"role": "user", "content": "u"}, assistant, {"role": "tool", "tool_call_id": "call_probe", "content": "r"}])
    };
    let string_arguments = r#"{"probe": "value"}"#;
    let arguments_as_string = source.contains("arguments is string")
        && probe(env, name, tool_turn(None, json!(string_arguments)), tools, tokens, true)
            .is_some_and(|out| out.contains(string_arguments));
    // Reading reasoning only as a string: the string prints, segments do not.
    let reads_reasoning = source.contains("reasoning_content");
    let reasoning_as_string = reads_reasoning && {
        const FIRST: &str = "\u{1}reasoning_probe_first\u{1}";
        const LAST: &str = "\u{1}reasoning_probe_last\u{1}";
        let arguments = if arguments_as_string { json!("{}") } else { json!({}) };
        let out = |reasoning| {
            probe(env, name, tool_turn(Some(reasoning), arguments.clone()), tools, tokens, true).unwrap_or_default()
        };
        out(json!(FIRST)).contains(FIRST) && {
            let segments = out(json!([FIRST, LAST]));
            !segments.contains(FIRST) && !segments.contains(LAST)
        }
    };
    Shapes { arguments_as_string, reads_reasoning, reasoning_as_string, demote_later_system, merge_consecutive_users }
}

/// Whether the default template renders only content arrays, and else which image
/// placeholder flattens a mixed array for it.
fn probe_content(env: &Environment) -> ContentShape {
    // The frontend's content probes set only these two keys: a template's `bos_token` or
    // `tools` is undefined here, not none.
    let render = |content: Json| {
        let context = json!({"messages": [{"role": "user", "content": content}], "add_generation_prompt": false});
        probe_render(env, DEFAULT, &context).unwrap_or_default()
    };
    let arrays = render(json!([{"type": "text", "text": "template_test"}])).contains("template_test")
        && !render(json!("template_test")).contains("template_test");
    if arrays {
        return ContentShape { arrays, image_placeholder: None };
    }
    let source = env.get_template(DEFAULT).map(|t| t.source().to_string()).unwrap_or_default();
    let image_placeholder = if source.contains("<|end|>") && source.contains("<|assistant|>") {
        Some("<|image_{n}|>")
    } else if source.contains("USER:") && source.contains("ASSISTANT:") {
        Some("<image>")
    } else {
        // A pass-through template prints the content alone, and a mixed array as its repr:
        // images are dropped from its text.
        const PROBE: &str = "\u{1}passthrough_probe\u{1}";
        let mixed = render(json!([{"type": "text", "text": PROBE}, {"type": "image"}]));
        (render(json!(PROBE)).trim() == PROBE && mixed.contains('[') && mixed.contains("type")).then_some("")
    };
    ContentShape { arrays, image_placeholder }
}

fn fromjson(value: Value) -> Result<Value, Error> {
    let Some(text) = value.as_str() else { return Ok(value) };
    serde_json::from_str::<Json>(text)
        .map(|parsed| Value::from_serialize(&parsed))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "cannot parse JSON").with_source(e))
}

/// The UTC time in `format`: the frontend uses its local time zone, which is UTC in the
/// containers it runs in.
fn strftime_now(format: &str) -> Result<Value, Error> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Ok(Value::from_safe_string(super::strftime::format_utc(format, now.as_secs())))
}

#[cfg(test)]
mod tests;

/// Every render of `tests/fixtures/dynamo-1.6.1/renders/captured.jsonl`, recorded from the
/// real dynamo.frontend 1.6.1 by `scripts/capture-renders`: eight templates (probes of the
/// context and the environment, and templates shaped like Qwen's, Gemma's strict
/// alternation, Phi-3-vision's, an array-only one, a pass-through and the fixture model's
/// chatml) over 62 bodies.
#[cfg(test)]
mod dynamo_parity {
    use serde_json::Value as Json;

    use super::ChatTemplate;
    use crate::kv::tests::fixture;

    /// Bodies the frontend refuses in validation the replica does not repeat (a strict tool
    /// schema's rules, parameters it does not support): they fail there whatever is hashed.
    const VALIDATED_ONLY_BY_THE_FRONTEND: [&str; 2] = ["tools_strict", "top_level_extras"];

    #[test]
    fn renders_match_the_real_frontends_byte_for_byte() {
        let dir = fixture("renders");
        let cases: Vec<Json> = std::fs::read_to_string(dir.join("cases.jsonl"))
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let mut compared = 0;
        let mut differences = Vec::new();
        for line in std::fs::read_to_string(dir.join("captured.jsonl")).unwrap().lines() {
            let record: Json = serde_json::from_str(line).unwrap();
            let name = record["template"].as_str().unwrap();
            let source = std::fs::read_to_string(dir.join(format!("templates/{name}.jinja"))).unwrap();
            let template = ChatTemplate::new(&serde_json::json!({"chat_template": source}), None).unwrap();
            let case = cases.iter().find(|c| c["name"] == record["case"]).unwrap();
            let ours = template.render(&case["body"]);
            let same = match (&ours, record.get("prompt").and_then(Json::as_str)) {
                (Ok(ours), Some(theirs)) => ours == theirs,
                (Err(_), None) => true,
                (Ok(_), None) => VALIDATED_ONLY_BY_THE_FRONTEND.contains(&record["case"].as_str().unwrap()),
                (Err(_), Some(_)) => false,
            };
            compared += 1;
            if !same {
                differences.push(format!(
                    "{name} / {}: frontend {}, replica {:?}",
                    record["case"],
                    record.get("prompt").unwrap_or(&record["error"]),
                    ours.map_err(|e| e.to_string())
                ));
            }
        }
        assert_eq!(compared, 8 * cases.len(), "every template's every case was captured");
        assert!(differences.is_empty(), "{} of {compared} differ:\n{}", differences.len(), differences.join("\n"));
    }
}
