//! The simulated direct-mode shim: `POST /v1/chat/completions` and `GET /v1/models` shaped
//! like `dynamo.frontend --router-mode direct` 1.6.1. A pinned request waits for its prefill
//! on its prefill worker, which (as a 1.6.1 mocker prefill worker does) publishes its idle
//! load once and nothing more, then holds KV blocks on its decode worker until its last token;
//! an aggregated worker holds them from the start. The kv_metrics publishers report those
//! changes, one rise and one fall per request.
//!
//! A request that carries its prompt's tokens (`nvext.token_data`, which a replica attaches
//! with `dynamo.kv.send_token_data`) has its full blocks stored in the prefix cache of the
//! worker that prefilled it (the prefill worker of a pair, as 1.6.1's decode workers publish
//! no kv-events, or the aggregated worker), which publishes them as kv-events; the part it
//! held already is answered as `usage.prompt_tokens_details.cached_tokens`. The shim has no tokenizer: a
//! request without tokens is sized from its text and stores nothing. It also serves the
//! fleet's model files (`GET /artifacts/...`, see `artifacts.rs`).
//!
//! `POST /simulator/workers/{id}/kill` kills a worker (see the module above): from then on a
//! request pinned to it is refused 503 "Service temporarily unavailable", and one it is running
//! breaks off, as with a SIGKILLed 1.6.1 worker whose lease still lives. Once its lease expires
//! its id is unknown ("Invalid request"), and with no decode worker left the model is gone: 404
//! with an empty body, and `/v1/models` lists nothing.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rand::Rng;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::artifacts;
use super::pins::{self, Known, Pins, Refusal, Resolution};
use super::prefix_cache;
use super::workers::{Life, SimulatedWorker};

/// How long the simulated prefill phase takes.
pub const PREFILL_TIME: Duration = Duration::from_millis(20);
/// How long each simulated output token takes.
pub const TOKEN_TIME: Duration = Duration::from_millis(5);
/// Output tokens when the request names no `max_tokens`, and the most it may ask for.
pub const DEFAULT_MAX_TOKENS: u64 = 16;
pub const MAX_TOKENS_CAP: u64 = 256;

/// The fleet the shim pins into.
#[derive(Debug)]
pub struct Shim {
    pub model: String,
    pub block_size: u64,
    pub prefill: Vec<Arc<SimulatedWorker>>,
    pub decode: Vec<Arc<SimulatedWorker>>,
    /// Where a kill is announced, for the simulator to close the worker's publishers and, a
    /// lease later, deregister it.
    pub killed: mpsc::Sender<u64>,
    pub lease_ttl: Duration,
}

impl Shim {
    pub fn workers(&self) -> impl Iterator<Item = &Arc<SimulatedWorker>> {
        self.prefill.iter().chain(&self.decode)
    }

    /// Whether discovery still holds a decode worker, which is what keeps the model served.
    fn serves_model(&self) -> bool {
        self.decode.iter().any(|w| w.life() != Life::Gone)
    }
}

/// The largest request body the shim reads: the replica's 8 MiB and the token ids it may add,
/// well within what the real frontend takes (axum's own 2 MiB default refused large prompts).
pub const MAX_BODY_BYTES: usize = 32 << 20;

pub fn router(shim: Arc<Shim>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat).layer(axum::middleware::from_fn(body_room)))
        .route("/v1/models", get(models))
        .route("/artifacts/{name}", get(artifacts::serve))
        .route("/simulator/workers/{id}/kill", post(kill))
        .route("/live", get(|| async { axum::Json(json!({"status": "live", "message": "Service is live"})) }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shim)
}

/// The bytes of chat request bodies the shim holds at once, at most: each request waits for
/// room for its declared length (a chunked one for the largest body) before its body is read,
/// so clients sending large bodies by the hundred queue rather than take the process's memory
/// (the shim runs inside the control plane).
const BODIES_IN_FLIGHT: usize = 256 << 20;
/// [`BODIES_IN_FLIGHT`] in kibibytes, a permit each.
static BODY_ROOM: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(BODIES_IN_FLIGHT >> 10);
const _: () = assert!(BODIES_IN_FLIGHT >= MAX_BODY_BYTES, "the largest body must fit");

async fn body_room(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let declared = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let kibibytes = declared.unwrap_or(MAX_BODY_BYTES).min(MAX_BODY_BYTES).div_ceil(1 << 10).max(1);
    let Ok(_room) = BODY_ROOM.acquire_many(u32::try_from(kibibytes).unwrap_or(u32::MAX)).await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    next.run(request).await
}

async fn models(State(shim): State<Arc<Shim>>) -> Response {
    let model =
        json!({"id": shim.model, "object": "model", "created": now_secs(), "owned_by": "nvidia", "context_window": 0});
    let models = if shim.serves_model() { vec![model] } else { Vec::new() };
    axum::Json(json!({"object": "list", "data": models})).into_response()
}

/// Kills the worker whose instance id (decimal, as Dynamo writes it) the path names.
async fn kill(State(shim): State<Arc<Shim>>, Path(id): Path<String>) -> Response {
    let Some(worker) = id.parse::<u64>().ok().and_then(|id| shim.workers().find(|w| w.worker_id == id)) else {
        let message = format!("no simulated worker has instance id {id:?}");
        return refuse(&Refusal { status: StatusCode::NOT_FOUND, message });
    };
    if !worker.kill() {
        let message = format!("worker {} is not serving: it was killed already", worker.worker_id);
        return refuse(&Refusal { status: StatusCode::CONFLICT, message });
    }
    // The queue holds a kill of every worker; a closed one means the simulator is stopping.
    let _ = shim.killed.try_send(worker.worker_id);
    let lease = shim.lease_ttl.as_secs_f64();
    axum::Json(json!({"killed": worker.worker_id, "deregistered_in_seconds": lease})).into_response()
}

/// A chat request as the shim reads it, without a tree of the whole: the fields it uses (each
/// at most [`MAX_FIELD_BYTES`] as written), the prompt's token ids (`nvext.token_data`, which
/// the replica sends when `send_token_data` is on) as four bytes each, and of the messages only
/// their text's length; every other field is skipped unread. As a JSON tree a 32 MiB body
/// would take gigabytes, for as long as the request is answered.
#[derive(serde::Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(default)]
    messages: Option<TextLength>,
    #[serde(borrow, default)]
    nvext: Option<Nvext<'a>>,
}

#[derive(serde::Deserialize)]
struct Nvext<'a> {
    #[serde(default)]
    token_data: Option<Vec<u32>>,
    #[serde(borrow, default)]
    extra_fields: Option<&'a RawValue>,
    #[serde(borrow, default)]
    backend_instance_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prefill_worker_id: Option<&'a RawValue>,
}

/// The most a field the shim reads as JSON may take as written (the messages and token ids
/// aside, which are read as they stream past).
const MAX_FIELD_BYTES: usize = 64 << 10;

/// The request as the shim reads it: its small fields as JSON, the length of its messages'
/// text, and its token ids.
struct ChatRequest {
    fields: Value,
    text: usize,
    tokens: Vec<u32>,
}

impl ChatBody<'_> {
    fn read(self) -> Result<ChatRequest, String> {
        let mut fields = serde_json::Map::new();
        let top = [
            ("model", self.model),
            ("stream", self.stream),
            ("stream_options", self.stream_options),
            ("max_tokens", self.max_tokens),
            ("max_completion_tokens", self.max_completion_tokens),
        ];
        read_fields(&mut fields, top)?;
        let mut tokens = Vec::new();
        if let Some(nvext) = self.nvext {
            let mut read = serde_json::Map::new();
            let own = [
                ("extra_fields", nvext.extra_fields),
                ("backend_instance_id", nvext.backend_instance_id),
                ("prefill_worker_id", nvext.prefill_worker_id),
            ];
            read_fields(&mut read, own)?;
            fields.insert("nvext".into(), Value::Object(read));
            tokens = nvext.token_data.unwrap_or_default();
        }
        let text = self.messages.map_or(0, |messages| messages.0);
        Ok(ChatRequest { fields: Value::Object(fields), text, tokens })
    }
}

/// Reads each field present as JSON, refusing one past [`MAX_FIELD_BYTES`].
fn read_fields<'a>(
    into: &mut serde_json::Map<String, Value>,
    fields: impl IntoIterator<Item = (&'static str, Option<&'a RawValue>)>,
) -> Result<(), String> {
    for (name, raw) in fields {
        let Some(raw) = raw else { continue };
        if raw.get().len() > MAX_FIELD_BYTES {
            return Err(format!("{name} is longer than {MAX_FIELD_BYTES} bytes"));
        }
        into.insert(name.into(), serde_json::from_str(raw.get()).map_err(|e| e.to_string())?);
    }
    Ok(())
}

/// The bytes of text the strings among the messages' `content` hold, read as they stream past.
struct TextLength(usize);

impl<'de> serde::Deserialize<'de> for TextLength {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Counting(Level::Messages)).map(TextLength)
    }
}

/// Where [`Counting`] reads: the message list, one message, or a message's content.
#[derive(Clone, Copy)]
enum Level {
    Messages,
    Message,
    Content,
}

struct Counting(Level);

impl<'de> serde::de::DeserializeSeed<'de> for Counting {
    type Value = usize;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Counting {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("chat messages")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<usize, E> {
        Ok(if matches!(self.0, Level::Content) { text.len() } else { 0 })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut total = 0usize;
        let item = match self.0 {
            Level::Messages => Level::Message,
            // A content of parts, or anything else in a list: no text the shim counts.
            _ => {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                return Ok(0);
            }
        };
        while let Some(text) = seq.next_element_seed(Counting(item))? {
            total = total.saturating_add(text);
        }
        Ok(total)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut total = 0usize;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if matches!(self.0, Level::Message) && key == "content" {
                total = total.saturating_add(map.next_value_seed(Counting(Level::Content))?);
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(total)
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<usize, E> {
        Ok(0)
    }
}

async fn chat(State(shim): State<Arc<Shim>>, headers: HeaderMap, body: Bytes) -> Response {
    let read = serde_json::from_slice::<ChatBody<'_>>(&body).map_err(|e| e.to_string()).and_then(ChatBody::read);
    drop(body);
    let ChatRequest { fields: request, text, tokens } = match read {
        Ok(request) => request,
        Err(error) => {
            let message = format!("Failed to deserialize the JSON body into the target type: {error}");
            return refuse(&Refusal { status: StatusCode::BAD_REQUEST, message });
        }
    };
    if request["model"].as_str() != Some(shim.model.as_str()) {
        return refuse(&Refusal { status: StatusCode::NOT_FOUND, message: "Model not found".to_owned() });
    }
    if !shim.serves_model() {
        // 1.6.1 once the last worker's lease expired: the model is gone, with no body.
        return StatusCode::NOT_FOUND.into_response();
    }
    let (prefill_ids, decode_ids) = (ids(&shim.prefill), ids(&shim.decode));
    let known = Known { prefill: &prefill_ids, decode: &decode_ids };
    let Resolution { prefill, pins } = match pins::resolve(&headers, &request, known) {
        Ok(resolution) => resolution,
        Err(refusal) => return refuse(&refusal),
    };
    let prompt = prefix_cache::blocks(&tokens, usize::try_from(shim.block_size).unwrap_or(usize::MAX));
    // A prefill worker of its own runs first, whatever the decode pin turns out to be: what
    // it held when the request arrived is cached, the rest stored once prefilled.
    let prefilled = match shim.prefill.iter().find(|w| w.worker_id == prefill) {
        // The capture pins a killed decode worker; a killed prefill worker is taken to be
        // refused the same way.
        Some(prefill) if prefill.life() == Life::Killed => return refuse(&Refusal::unavailable()),
        Some(prefill) => {
            prefill.touch();
            let cached = prefill.held(&prompt);
            tokio::time::sleep(PREFILL_TIME).await;
            prefill.store_prompt(&prompt);
            Some(cached)
        }
        None => None,
    };
    let pins = match pins {
        Ok(pins) => pins,
        Err(refusal) => return refuse(&refusal),
    };
    let Some(decode) = shim.decode.iter().find(|w| w.worker_id == pins.decode) else {
        return refuse(&Refusal::invalid());
    };
    if decode.life() == Life::Killed {
        return refuse(&Refusal::unavailable());
    }
    let mut plan = Plan::new(&shim, &request, (text, &tokens), pins);
    // The sequence's blocks, prompt and answer together, as an engine pages them.
    let blocks = (plan.prompt_tokens + plan.tokens).div_ceil(shim.block_size);
    decode.touch();
    let held = Held::take(decode, blocks);
    let cached = match prefilled {
        Some(cached) => cached,
        // Aggregated: the decode worker prefills the request itself.
        None => {
            let cached = decode.held(&prompt);
            tokio::time::sleep(PREFILL_TIME).await;
            decode.store_prompt(&prompt);
            cached
        }
    };
    plan.cached_tokens = u64::try_from(cached).unwrap_or(u64::MAX).saturating_mul(shim.block_size);
    if request["stream"] == true {
        let usage = request["stream_options"]["include_usage"] == true;
        return stream(plan, usage, held);
    }
    tokio::time::sleep(TOKEN_TIME * u32::try_from(plan.tokens).unwrap_or(u32::MAX)).await;
    if held.worker.life() != Life::Serving {
        return refuse(&Refusal::unavailable());
    }
    drop(held);
    axum::Json(plan.completion()).into_response()
}

/// The ids discovery holds: a killed worker's until its lease expires.
fn ids(workers: &[Arc<SimulatedWorker>]) -> Vec<u64> {
    workers.iter().filter(|w| w.life() != Life::Gone).map(|w| w.worker_id).collect()
}

/// KV blocks a request holds on a worker; given back when dropped, even if the client left.
struct Held {
    worker: Arc<SimulatedWorker>,
    blocks: u64,
}

impl Held {
    fn take(worker: &Arc<SimulatedWorker>, blocks: u64) -> Self {
        // Only what was taken goes back: a request past the capacity must not free blocks
        // another request still holds.
        let blocks = worker.add(blocks);
        Self { worker: Arc::clone(worker), blocks }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.worker.release(self.blocks);
    }
}

/// What one request produces.
struct Plan {
    id: String,
    model: String,
    created: u64,
    prompt_tokens: u64,
    /// The prompt's leading tokens its prefill worker held already.
    cached_tokens: u64,
    tokens: u64,
    echo: Option<Value>,
}

impl Plan {
    /// The answer to `request`, whose messages hold `text` bytes of text and whose prompt is
    /// `tokens` when the replica sent them.
    fn new(shim: &Shim, request: &Value, (text, tokens): (usize, &[u32]), pins: Pins) -> Self {
        let estimate = u64::try_from(text / 4).unwrap_or(u64::MAX).saturating_add(8);
        let prompt_tokens = if tokens.is_empty() { estimate } else { tokens.len() as u64 };
        let asked = request["max_tokens"].as_u64().or_else(|| request["max_completion_tokens"].as_u64());
        let wants_echo =
            request["nvext"]["extra_fields"].as_array().is_some_and(|f| f.iter().any(|f| f == "worker_id"));
        Self {
            id: format!("chatcmpl-{:032x}", rand::rng().random::<u128>()),
            model: shim.model.clone(),
            created: now_secs(),
            prompt_tokens,
            cached_tokens: 0,
            tokens: asked.unwrap_or(DEFAULT_MAX_TOKENS).clamp(1, MAX_TOKENS_CAP),
            echo: wants_echo.then(|| worker_id(pins)),
        }
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
               "total_tokens": self.prompt_tokens + self.tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }

    /// The frontend's member order: id, choices, created, model, object, usage, nvext.
    fn completion(&self) -> Value {
        let content: Vec<String> = (0..self.tokens).map(|_| word()).collect();
        let message = json!({"content": content.concat(), "refusal": null, "role": "assistant"});
        let mut body = json!({
            "id": self.id,
            "choices": [{"index": 0, "message": message, "finish_reason": "length", "logprobs": null}],
            "created": self.created, "model": self.model, "object": "chat.completion", "usage": self.usage(),
        });
        if let Some(echo) = &self.echo {
            body["nvext"] = json!({"worker_id": echo});
        }
        body
    }

    /// A chunk with `choices` (and `usage`, for the last of a stream that asked for it).
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id, "choices": choices, "created": self.created, "model": self.model,
            "object": "chat.completion.chunk",
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        if let Some(echo) = &self.echo {
            chunk["nvext"] = json!({"worker_id": echo});
        }
        chunk
    }

    /// The stream's events as the frontend sends them: a chunk per token (the first with the
    /// assistant's role), one with an empty delta and the finish reason, one with no choices
    /// and the usage when the request asked for it (`stream_options.include_usage`).
    fn events(&self, include_usage: bool) -> impl Iterator<Item = Value> + '_ {
        let tokens = (0..self.tokens).map(|index| {
            let delta =
                if index == 0 { json!({"content": word(), "role": "assistant"}) } else { json!({"content": word()}) };
            self.chunk(json!([{"index": 0, "delta": delta, "finish_reason": null, "logprobs": null}]), None)
        });
        let finish = self.chunk(json!([{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": null}]), None);
        let usage = include_usage.then(|| self.chunk(json!([]), Some(self.usage())));
        tokens.chain(std::iter::once(finish)).chain(usage)
    }
}

/// SSE events, a token's every [`TOKEN_TIME`], then `data: [DONE]`; the decode blocks are
/// held to the end. A stream whose worker is killed breaks off without its `[DONE]`.
fn stream(plan: Plan, include_usage: bool, held: Held) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        for (index, event) in plan.events(include_usage).enumerate() {
            if u64::try_from(index).is_ok_and(|i| i < plan.tokens) {
                tokio::time::sleep(TOKEN_TIME).await;
            }
            if held.worker.life() != Life::Serving {
                let _ = tx.send(Err(std::io::Error::other("the worker was killed"))).await;
                return;
            }
            if tx.send(Ok(Bytes::from(format!("data: {event}\n\n")))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let body = Body::from_stream(ReceiverStream::new(rx));
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// The pins the frontend used, in its order; a decode rank alone applies to the prefill too.
fn worker_id(pins: Pins) -> Value {
    let mut echo = serde_json::Map::new();
    echo.insert("prefill_worker_id".into(), json!(pins.prefill));
    if let Some(rank) = pins.prefill_dp_rank.or(pins.decode_dp_rank) {
        echo.insert("prefill_dp_rank".into(), json!(rank));
    }
    echo.insert("decode_worker_id".into(), json!(pins.decode));
    if let Some(rank) = pins.decode_dp_rank {
        echo.insert("decode_dp_rank".into(), json!(rank));
    }
    Value::Object(echo)
}

fn word() -> String {
    let mut rng = rand::rng();
    let len = rng.random_range(1..=4);
    let letters: String = (0..len).map(|_| char::from(b'a' + rng.random_range(0..26u8))).collect();
    format!(" {letters}")
}

fn refuse(refusal: &Refusal) -> Response {
    let reason = refusal.status.canonical_reason().unwrap_or("Error");
    let body = json!({"message": refusal.message, "type": reason, "code": refusal.status.as_u16()});
    (refusal.status, axum::Json(body)).into_response()
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn read(body: &Value) -> Result<ChatRequest, String> {
        let text = body.to_string();
        serde_json::from_str::<ChatBody<'_>>(&text).map_err(|e| e.to_string()).and_then(ChatBody::read)
    }

    /// The shim reads what it uses and skips the rest unread: the messages only for their
    /// text's length (a content of parts counts none), the token ids as numbers.
    #[test]
    fn a_request_is_read_for_what_the_shim_uses() -> Result<(), String> {
        let body = json!({
            "model": "tiny", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}, {"content": [{"type": "text", "text": "x"}]},
                         {"role": "assistant", "content": "abc", "name": "n"}, {"role": "user"}],
            "tools": [{"type": "function"}], "temperature": 0.5,
            "nvext": {"token_data": [1, 2, 3], "extra_fields": ["worker_id"], "backend_instance_id": 7, "ignore_eos": true},
        });
        let ChatRequest { fields, text, tokens } = read(&body)?;
        assert_eq!((text, tokens), (8, vec![1, 2, 3]));
        let expected = json!({"model": "tiny", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 4,
                              "nvext": {"extra_fields": ["worker_id"], "backend_instance_id": 7}});
        assert_eq!(fields, expected);
        // A key written with escapes is the same key.
        let escaped: ChatBody<'_> =
            serde_json::from_str(r#"{"messages":[{"\u0063ontent":"four"}]}"#).map_err(|e| e.to_string())?;
        assert_eq!(escaped.read()?.text, 4);
        Ok(())
    }

    /// A request waits for room for its declared body before the body is read, and goes on
    /// once room is given back.
    #[tokio::test]
    async fn a_body_waits_for_room_before_it_is_read() {
        use tower_service::Service;

        let echo = post(|body: Bytes| async move { body.len().to_string() });
        let mut app: Router = Router::new().route("/", echo.layer(axum::middleware::from_fn(body_room)));
        let request = |length: usize| {
            axum::http::Request::post("/")
                .header(header::CONTENT_LENGTH, length)
                .body(Body::from(vec![b'x'; length]))
                .expect("a request")
        };
        let all_but_one_kib = u32::try_from((BODIES_IN_FLIGHT >> 10) - 1).expect("permits");
        let held = BODY_ROOM.acquire_many(all_but_one_kib).await.expect("room");
        let small = app.call(request(1 << 10)).await.expect("answered");
        assert_eq!(small.status(), StatusCode::OK, "one KiB fits what is left");
        let large = tokio::spawn({
            let mut app = app.clone();
            async move { app.call(request(2 << 10)).await.map(|answer| answer.status()) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!large.is_finished(), "two KiB wait for room");
        drop(held);
        let answered = tokio::time::timeout(Duration::from_secs(5), large).await;
        assert!(matches!(answered, Ok(Ok(Ok(StatusCode::OK)))), "{answered:?}");
    }

    /// A field the shim reads as JSON is refused past its bound; the messages and token ids,
    /// read as they pass, have none but the body's.
    #[test]
    fn a_field_read_as_json_has_a_bound() -> Result<(), String> {
        let long = "x".repeat(MAX_FIELD_BYTES);
        let refused = read(&json!({"model": long})).err().unwrap_or_default();
        assert!(refused.contains("model is longer than"), "{refused}");
        let messages = json!({"messages": [{"content": "x".repeat(4 * MAX_FIELD_BYTES)}], "nvext": {"token_data": vec![7u32; 100_000]}});
        let ChatRequest { text, tokens, .. } = read(&messages)?;
        assert_eq!((text, tokens.len()), (4 * MAX_FIELD_BYTES, 100_000));
        Ok(())
    }
}
