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
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/artifacts/{name}", get(artifacts::serve))
        .route("/simulator/workers/{id}/kill", post(kill))
        .route("/live", get(|| async { axum::Json(json!({"status": "live", "message": "Service is live"})) }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shim)
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

/// A chat request as the shim reads it: the prompt's token ids (`nvext.token_data`, which
/// the replica sends when `send_token_data` is on) as four bytes each, the rest as JSON. As a
/// JSON tree a 32 MiB body of ids would take hundreds of megabytes.
#[derive(serde::Deserialize)]
struct ChatBody {
    #[serde(default)]
    nvext: Option<Nvext>,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(serde::Deserialize)]
struct Nvext {
    #[serde(default)]
    token_data: Option<Vec<u32>>,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

impl ChatBody {
    /// The request without its token ids, and the ids (none when it carries none).
    fn split(self) -> (Value, Vec<u32>) {
        let mut request = self.rest;
        let tokens = self.nvext.and_then(|nvext| {
            request.insert("nvext".into(), Value::Object(nvext.rest));
            nvext.token_data
        });
        (Value::Object(request), tokens.unwrap_or_default())
    }
}

async fn chat(State(shim): State<Arc<Shim>>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, tokens) = match serde_json::from_slice::<ChatBody>(&body) {
        Ok(request) => request.split(),
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
    let mut plan = Plan::new(&shim, &request, &tokens, pins);
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
    fn new(shim: &Shim, request: &Value, tokens: &[u32], pins: Pins) -> Self {
        let text: usize = request["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter_map(|m| m["content"].as_str()).map(str::len).sum());
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
