//! The ingress phase's reading of a chat completion request: bounded, valid JSON, and just
//! enough of the OpenAI shape checked to route it. Everything else is the frontend's to judge.

use std::time::Duration;

use bytes::Bytes;
use futures::future::Either;
use serde::Deserialize;
use serde::de::{MapAccess, Visitor};
use serde_json::Value;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::json_shape::{Checked, Key, Keys, Scalar, Shape, UniqueObject};
use crate::kv::request_cache_salt;
use crate::memory::free_off_the_runtime;
use crate::routing::headers::{ENGINE_ROUTING_FIELDS, strip_body_routing, with_token_data};
use crate::routing::picker::PromptText;

/// The largest request body accepted (the server refuses larger ones before reading them):
/// long multi-turn prompts with inline images fit.
pub const MAX_REQUEST_BODY_BYTES: usize = 8 << 20;
/// Bytes of bodies whose JSON trees may be built or held at once, process-wide. A tree takes up
/// to about forty times its body (`[0,0,…]` is two bytes an element, a `Value` with ordered
/// maps 80), so without a bound a few hundred concurrent large bodies would take tens of
/// gigabytes; past it, a request waits for the trees ahead of it. Four bodies of the largest
/// size fit at once, about 1.3 GB of trees at the very worst.
pub const MAX_TREE_BYTES_IN_FLIGHT: usize = 4 * MAX_REQUEST_BODY_BYTES;

/// Bytes of bodies up to `ON_THE_RUNTIME_BYTES` whose trees may be held at once: a budget of
/// their own, since the large bodies' is fair (first come, first served) and a small request
/// must not wait behind a large one for room it would fit in. About 330 MB of trees at the very
/// worst, and thousands of ordinary requests' at once.
pub const MAX_SMALL_TREE_BYTES_IN_FLIGHT: usize = 8 << 20;

static TREES: Semaphore = Semaphore::const_new(MAX_TREE_BYTES_IN_FLIGHT);
static SMALL_TREES: Semaphore = Semaphore::const_new(MAX_SMALL_TREE_BYTES_IN_FLIGHT);

/// Room for one JSON tree under [`MAX_TREE_BYTES_IN_FLIGHT`], given back when dropped.
type TreeRoom = Option<SemaphorePermit<'static>>;

/// A body's JSON tree with its room under [`MAX_TREE_BYTES_IN_FLIGHT`]. The room goes back when
/// the tree is dropped by whoever holds it last: a render abandoned at its deadline shares the
/// tree, not a copy, so the tree and its room last until that render's job ends.
#[derive(Debug)]
pub struct Tree {
    value: Value,
    room: TreeRoom,
    /// The size of the body it was parsed from.
    bytes: usize,
}

/// Bodies up to this size are parsed into a tree, and the tree freed, where it happens; a
/// larger one is parsed and freed on the blocking pool: an 8 MiB body takes a tree hundreds of
/// milliseconds to build and tens to free, which on a runtime thread would hold up every
/// connection and stream beside it.
pub(crate) const ON_THE_RUNTIME_BYTES: usize = 64 << 10;

/// Work on bodies past `ON_THE_RUNTIME_BYTES` running or queued on the blocking pool at once.
/// Handed over, such work runs to its end even when its request is dropped (its client left),
/// holding its body after the connection has given the body's charge back: the permit, taken
/// before the hand-over and held by the work, bounds what it holds to this many bodies.
/// Sixteen: more than the blocking pool runs at once on the hosts a replica runs on, and at
/// most 128 MiB of bodies held by abandoned work.
pub const MAX_OFF_RUNTIME_WORK: usize = 16;

static OFF_RUNTIME: Semaphore = Semaphore::const_new(MAX_OFF_RUNTIME_WORK);

/// Runs `work`, for a body of `bytes`, where `ON_THE_RUNTIME_BYTES` says. Off the runtime it
/// waits for its turn until `deadline` at most (`None`: as long as it takes); `None` without a
/// turn by then, or if the work panicked.
async fn sized_work<T: Send + 'static>(
    bytes: usize,
    deadline: Option<tokio::time::Instant>,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if bytes <= ON_THE_RUNTIME_BYTES {
        return Some(work());
    }
    // Never closed, so always granted in turn; a request dropped while it waits holds nothing.
    let permit = until(deadline, OFF_RUNTIME.acquire()).await?.ok()?;
    tokio::task::spawn_blocking(move || {
        let _held = permit;
        work()
    })
    .await
    .ok()
}

/// `future`'s output if it comes by `deadline` (`None`: whenever it comes).
async fn until<F: Future>(deadline: Option<tokio::time::Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, future).await.ok(),
        None => Some(future.await),
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        if self.bytes <= ON_THE_RUNTIME_BYTES || self.value.is_null() {
            return;
        }
        // Off the runtime, and its room given back only once the tree is gone.
        free_off_the_runtime((std::mem::take(&mut self.value), self.room.take()));
    }
}

impl std::ops::Deref for Tree {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.value
    }
}

/// What a JSON error says of the body: a key given twice, or more keys than an object may hold,
/// is valid JSON (RFC 8259) the ingress refuses, not a syntax error.
fn json_verdict(error: &serde_json::Error) -> &'static str {
    match error.is_data() {
        true => "the request body's JSON is refused",
        false => "the request body is not valid JSON",
    }
}

impl std::borrow::Borrow<Value> for Tree {
    fn borrow(&self) -> &Value {
        &self.value
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or JSON the ingress will not read (a key twice in one object, too many keys).
    #[error("{verdict}: {0}", verdict = json_verdict(.0))]
    Json(#[source] serde_json::Error),
    #[error("{0}")]
    Shape(&'static str),
    /// No room for the body's JSON tree within [`OUTBOUND_TREE_WAIT`]: larger bodies hold it.
    #[error("the replica holds as many large request bodies as it may")]
    Busy,
    /// Rewritten (routing fields stripped, numbers written as JSON readers write them), the
    /// body would grow past [`MAX_REWRITE_GROWTH`] times its size.
    #[error(
        "rewritten for the model server, the body would grow to {bytes} bytes, more than {MAX_REWRITE_GROWTH} times its size: numbers in exponent form (1e15) are written out in full"
    )]
    Grows { bytes: usize },
}

/// How much larger than the client's body its rewrite may be, beside the rendered tokens it
/// adds: the rewrite is held, uncharged, beside the charged body for the whole dispatch, and
/// `1e15` written back is `1000000000000000.0`, so an 8 MiB body of such numbers would make
/// some 36 MiB. No body written as clients write JSON comes near it.
pub const MAX_REWRITE_GROWTH: usize = 2;

/// How long making the outbound body waits for room for its tree; past it the request is
/// refused as busy, rather than queued behind renders of large bodies for as long as they run.
pub const OUTBOUND_TREE_WAIT: Duration = Duration::from_secs(2);
/// How long reading a large body waits for its turn on the blocking pool
/// ([`MAX_OFF_RUNTIME_WORK`]); past it the request is refused as busy.
pub const LARGE_WORK_WAIT: Duration = Duration::from_secs(2);

/// A body a shim may be sent: made only by [`ChatRequest::outbound`], the client's routing
/// body fields stripped (or none there to strip, read so at the ingress). The dispatcher takes
/// no other, so no body reaches a shim without the hygiene; the headers it sends are checked
/// again as they are encoded (`dispatch::wire`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboundBody(Bytes);

/// Read as the bytes it is; made only as above.
impl std::ops::Deref for OutboundBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl OutboundBody {
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// A body for the dispatcher's own tests, which have no client request.
    #[cfg(test)]
    pub(crate) fn for_tests(body: &'static [u8]) -> Self {
        Self(Bytes::from_static(body))
    }
}

/// A chat completion request as the client sent it, read in one pass without building a JSON
/// tree: what routing needs is measured as the body is parsed, and the body itself is kept as
/// bytes, forwarded as they came unless something in them must change ([`ChatRequest::outbound`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The body exactly as the client sent it; `model` in it is the client's model id.
    pub raw: Bytes,
    pub model: String,
    pub stream: bool,
    /// The picker's estimate of the prompt's tokens, from its prompt fields.
    pub prompt_estimate: u64,
    /// The prompt holds media, which the estimate leaves out: its answer's count of the prompt
    /// teaches the estimate nothing.
    pub prompt_has_media: bool,
    /// The body has an `nvext` member, which may hold routing fields to strip, or an engine's
    /// own routing field ([`ENGINE_ROUTING_FIELDS`]).
    has_nvext: bool,
    /// The client's `x-tenant-id`: the request's cache salt, over the body's.
    tenant: Option<String>,
}

/// Members the frontend reads into typed objects, which refuse a key that comes twice: so are
/// they refused here, before a pick (a buffered request the frontend refuses comes back as the
/// pinned dispatch's failure). Free-form ones (`metadata`, `logit_bias`) keep a repeat's last.
const TYPED_OBJECTS: [&str; 4] = ["stream_options", "response_format", "prediction", "audio"];

/// The members routing reads; everything else is only checked to be valid JSON ([`Checked`]),
/// and no member may come twice (the frontend refuses a request with one twice; a rewrite of
/// the body would keep only the last). None is built as a tree: a `model` of eight megabytes of
/// `[0,0,…]` would take hundreds of them.
#[derive(Default)]
struct Members {
    model: Option<Scalar>,
    stream: Option<Scalar>,
    /// The prompt is what the chat template renders: the messages and the tools. Other
    /// members (a stray `prompt`, `input` or `system`) never reach the model, so counting them
    /// would let a client skew the per-model calibration of every later estimate.
    messages: Option<PromptText>,
    tools: Option<PromptText>,
    /// `"none"` keeps the tools out of what the frontend renders, so out of the estimate too.
    tool_choice: Option<Scalar>,
    /// Only an object is routing's to strip fields from. A frontend reads an array as its
    /// `NvExt` fields in declaration order (serde's sequence form of a struct), so
    /// `[null, null, null, 7]` would name a worker without naming a field.
    /// Its own fields unique: a second copy of one would ride past the strip.
    nvext: Option<UniqueObject>,
    /// An engine's own routing field, to strip ([`ENGINE_ROUTING_FIELDS`]).
    engine_routing: bool,
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members;

            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a chat completion request object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let (mut members, mut keys) = (Members::default(), Keys::default());
                while let Some(Key(key)) = map.next_key()? {
                    match key.as_ref() {
                        "model" => members.model = map.next_value()?,
                        "stream" => members.stream = map.next_value()?,
                        "messages" => members.messages = map.next_value()?,
                        "tools" => members.tools = map.next_value()?,
                        "tool_choice" => members.tool_choice = map.next_value()?,
                        "nvext" => members.nvext = map.next_value()?,
                        field if TYPED_OBJECTS.contains(&field) => {
                            map.next_value::<UniqueObject>()?;
                        }
                        field if ENGINE_ROUTING_FIELDS.contains(&field) => {
                            map.next_value::<Checked>()?;
                            members.engine_routing = true;
                        }
                        _ => {
                            map.next_value::<Checked>()?;
                        }
                    }
                    keys.insert(key)?;
                }
                Ok(members)
            }
        }
        deserializer.deserialize_map(MembersVisitor)
    }
}

impl ChatRequest {
    /// [`ChatRequest::parse`] where `ON_THE_RUNTIME_BYTES` says: reading a body of
    /// megabytes (every member checked, every prompt string counted) would hold up every
    /// connection beside it on a runtime thread.
    ///
    /// Not an `async fn`: a small body is parsed here and then, and only a large one's wait
    /// (boxed) is part of the future every request awaits.
    pub fn read(raw: Bytes) -> impl Future<Output = Result<Self, RequestError>> {
        if raw.len() <= ON_THE_RUNTIME_BYTES {
            return Either::Left(std::future::ready(Self::parse(raw)));
        }
        Either::Right(Box::pin(async move {
            let deadline = tokio::time::Instant::now() + LARGE_WORK_WAIT;
            sized_work(raw.len(), Some(deadline), move || Self::parse(raw)).await.ok_or(RequestError::Busy)?
        }))
    }

    pub fn parse(raw: Bytes) -> Result<Self, RequestError> {
        if raw.trim_ascii_start().first() != Some(&b'{') {
            serde_json::from_slice::<Checked>(&raw).map_err(RequestError::Json)?;
            return Err(RequestError::Shape("the request body must be a JSON object"));
        }
        // Checked as UTF-8 once, whole: read from bytes, serde_json checks each string apart,
        // at a cost of some ninety instructions a string however short. Bytes that are not
        // UTF-8 are read as bytes, for the error serde_json gives them.
        let members: Members = match std::str::from_utf8(&raw) {
            Ok(text) => serde_json::from_str(text),
            Err(_) => serde_json::from_slice(&raw),
        }
        .map_err(RequestError::Json)?;
        let model = match members.model {
            Some(Scalar::Str(model)) if !model.is_empty() => model,
            _ => {
                return Err(RequestError::Shape(
                    "`model` must be a non-empty string naming a model from GET /v1/models",
                ));
            }
        };
        let messages = match members.messages {
            Some(messages @ PromptText { items: Some(1..), .. }) => messages,
            _ => return Err(RequestError::Shape("`messages` must be a non-empty array of chat messages")),
        };
        let stream = match members.stream {
            None => false,
            Some(Scalar::Bool(stream)) => stream,
            Some(_) => return Err(RequestError::Shape("`stream` must be true or false")),
        };
        if members.nvext.as_ref().is_some_and(|UniqueObject(shape)| *shape != Shape::Object) {
            return Err(RequestError::Shape("`nvext` must be an object"));
        }
        // As the frontend hands the template its tools: none under `tool_choice: "none"` (but
        // for a model card that keeps them, whose prompts this estimate then undercounts).
        let unrendered = matches!(&members.tool_choice, Some(Scalar::Str(choice)) if choice == "none");
        let tools = members.tools.filter(|_| !unrendered).map_or(0, |tools| tools.tokens);
        let prompt_estimate = messages.tokens.saturating_add(tools);
        Ok(Self {
            raw,
            model,
            stream,
            prompt_estimate,
            prompt_has_media: messages.media,
            has_nvext: members.nvext.is_some() || members.engine_routing,
            tenant: None,
        })
    }

    /// The request as sent with an `x-tenant-id` header: `tenant` salts its KV blocks.
    pub fn with_tenant(self, tenant: Option<String>) -> Self {
        Self { tenant, ..self }
    }

    /// The client's tenant, which goes on to the frontend as its `x-tenant-id`.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The salt the frontend will hash the prompt's blocks with: the tenant, else the body's.
    pub fn cache_salt<'a>(&'a self, body: &'a Value) -> Option<&'a str> {
        self.tenant.as_deref().or_else(|| request_cache_salt(body))
    }

    /// The body as a JSON tree, parsed anew (KV rendering reads it), once there is room for
    /// it under its budget ([`MAX_TREE_BYTES_IN_FLIGHT`], or [`MAX_SMALL_TREE_BYTES_IN_FLIGHT`]
    /// for a small body); the room is held as long as the tree.
    pub async fn tree(&self) -> Result<Tree, RequestError> {
        self.tree_within(Duration::MAX).await
    }

    /// [`Self::tree`], waiting at most `wait` for the room and for a large body's turn on the
    /// blocking pool (and not for the parse, which a large body takes long over on an idle
    /// machine too): [`RequestError::Busy`] without them.
    pub async fn tree_within(&self, wait: Duration) -> Result<Tree, RequestError> {
        let (budget, size) = if self.raw.len() <= ON_THE_RUNTIME_BYTES {
            (&SMALL_TREES, MAX_SMALL_TREE_BYTES_IN_FLIGHT)
        } else {
            (&TREES, MAX_TREE_BYTES_IN_FLIGHT)
        };
        // A body is at most MAX_REQUEST_BODY_BYTES, well within a u32. The budget is never
        // closed, so the room is always granted.
        let bytes = u32::try_from(self.raw.len().min(size)).unwrap_or(u32::MAX);
        let acquire = budget.acquire_many(bytes);
        let deadline = tokio::time::Instant::now().checked_add(wait);
        let room = until(deadline, acquire).await.ok_or(RequestError::Busy)?.ok();
        let raw = self.raw.clone();
        // The room goes with the parse: one on the blocking pool runs to its end even when the
        // caller stops waiting (a deadline), and the tree it builds must stay counted until
        // it is freed, with the room, wherever the parse ends.
        let parse = move || (serde_json::from_slice(&raw), room);
        let (parsed, room) = sized_work(self.raw.len(), deadline, parse).await.ok_or(RequestError::Busy)?;
        Ok(Tree { value: parsed.map_err(RequestError::Json)?, room, bytes: self.raw.len() })
    }

    /// The body to send to a shim: the client's `nvext` routing fields stripped and, when
    /// given, the rendered prompt attached as `nvext.token_data`. A body with neither to do is
    /// forwarded byte for byte, without re-serializing it.
    ///
    /// Not an `async fn`, for [`ChatRequest::read`]'s reason: only a rewrite's work is boxed.
    pub fn outbound(
        &self,
        token_data: Option<Vec<u32>>,
        disclose: bool,
    ) -> impl Future<Output = Result<OutboundBody, RequestError>> + '_ {
        if !self.has_nvext && token_data.is_none() {
            return Either::Left(std::future::ready(Ok(OutboundBody(self.raw.clone()))));
        }
        Either::Right(Box::pin(self.rewritten(token_data, disclose)))
    }

    /// [`ChatRequest::outbound`] when the body must change.
    async fn rewritten(&self, token_data: Option<Vec<u32>>, disclose: bool) -> Result<OutboundBody, RequestError> {
        let deadline = tokio::time::Instant::now() + OUTBOUND_TREE_WAIT;
        let mut tree = match self.tree_within(OUTBOUND_TREE_WAIT).await {
            Ok(tree) => tree,
            // Only the rendered tokens were to be added, a saving of the frontend's: it
            // tokenizes the prompt itself without them.
            Err(RequestError::Busy) if !self.has_nvext => return Ok(OutboundBody(self.raw.clone())),
            Err(error) => return Err(error),
        };
        // The tokens added take at most 11 bytes each (ten digits and a comma).
        let most = MAX_REWRITE_GROWTH * self.raw.len() + 11 * token_data.as_ref().map_or(0, Vec::len) + 64;
        let rewrite = move || {
            strip_body_routing(&mut tree.value, disclose);
            let body = match token_data {
                Some(tokens) => with_token_data(&tree.value, &tokens),
                None => serde_json::to_vec(&tree.value),
            };
            let body = body.map_err(RequestError::Json);
            // Freed here, off the runtime too.
            drop(std::mem::take(&mut tree.value));
            match body {
                Ok(body) if body.len() > most => Err(RequestError::Grows { bytes: body.len() }),
                body => body,
            }
        };
        match sized_work(self.raw.len(), Some(deadline), rewrite).await {
            Some(body) => Ok(OutboundBody(Bytes::from(body?))),
            None if !self.has_nvext => Ok(OutboundBody(self.raw.clone())),
            None => Err(RequestError::Busy),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn parse(text: &str) -> Result<ChatRequest, String> {
        ChatRequest::parse(Bytes::from(text.to_string())).map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn reads_model_stream_and_prompt_size_and_keeps_the_body_whole() {
        let text = r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true,"nvext":{"x":1}}"#;
        let request = parse(text).unwrap();
        assert_eq!((request.model.as_str(), request.stream, request.prompt_estimate), ("qwen", true, 2 + 2));
        assert_eq!(request.tree().await.unwrap()["nvext"]["x"], 1);
        assert!(!parse(r#"{"model":"m","messages":[{}],"stream":null}"#).unwrap().stream);
        let prompt_fields = r#"{"model":"m","messages":[{"content":"abcdefgh"}],"tools":[{"n":"abcd"}]}"#;
        assert_eq!(parse(prompt_fields).unwrap().prompt_estimate, 2 + 2);
        assert!(!request.prompt_has_media && !parse(prompt_fields).unwrap().prompt_has_media);
        let image =
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#;
        assert!(parse(image).unwrap().prompt_has_media, "an image in the prompt");
        // Members the chat template does not render are not the prompt.
        let unrendered =
            r#"{"model":"m","messages":[{"content":"abcdefgh"}],"prompt":"abcd","input":"abcd","system":"abcd"}"#;
        assert_eq!(parse(unrendered).unwrap().prompt_estimate, 2);
        let choice_none =
            r#"{"model":"m","messages":[{"content":"abcdefgh"}],"tools":[{"n":"abcd"}],"tool_choice":"none"}"#;
        assert_eq!(parse(choice_none).unwrap().prompt_estimate, 2, "tools the template is not given");
        let choice_auto =
            r#"{"model":"m","messages":[{"content":"abcdefgh"}],"tools":[{"n":"abcd"}],"tool_choice":"auto"}"#;
        assert_eq!(parse(choice_auto).unwrap().prompt_estimate, 2 + 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parse_abandoned_on_the_blocking_pool_holds_its_room_until_its_tree_is_gone() {
        let _filling = crate::memory::FILLING.lock().await;
        let zeros = vec!["0"; (MAX_REQUEST_BODY_BYTES - 100) / 2].join(",");
        let request = parse(&format!(r#"{{"model":"m","messages":[{{"content":[{zeros}]}}]}}"#)).unwrap();
        let free = TREES.available_permits();
        let mut parsing = Box::pin(request.tree());
        // Long enough to take its room and start; far shorter than building millions of nodes.
        if tokio::time::timeout(Duration::from_millis(1), &mut parsing).await.is_ok() {
            panic!("parsed 4 M numbers within a millisecond; the abandonment went untested");
        }
        drop(parsing);
        assert!(TREES.available_permits() < free, "the parse still running holds its room");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while TREES.available_permits() < free {
            assert!(tokio::time::Instant::now() < deadline, "the room came back once the parse ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Work abandoned on the blocking pool still holds its body: at most MAX_OFF_RUNTIME_WORK
    /// pieces of it run or wait there at once, however many requests are dropped meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_abandoned_on_the_blocking_pool_is_bounded() {
        let _filling = crate::memory::FILLING.lock().await;
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(std::sync::Mutex::new(released));
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let abandoned: Vec<_> = (0..MAX_OFF_RUNTIME_WORK + 3)
            .map(|_| {
                let (released, started) = (Arc::clone(&released), Arc::clone(&started));
                tokio::spawn(sized_work(ON_THE_RUNTIME_BYTES + 1, None, move || {
                    started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = released.lock().map(|released| released.recv());
                }))
            })
            .collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while started.load(std::sync::atomic::Ordering::SeqCst) < MAX_OFF_RUNTIME_WORK {
            assert!(tokio::time::Instant::now() < deadline, "the first pieces of work started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for request in &abandoned {
            request.abort();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(OFF_RUNTIME.available_permits(), 0, "the abandoned work still runs, each holding a permit");
        assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), MAX_OFF_RUNTIME_WORK, "the rest waited");
        for _ in 0..MAX_OFF_RUNTIME_WORK {
            let _ = release.send(());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while OFF_RUNTIME.available_permits() < MAX_OFF_RUNTIME_WORK {
            assert!(tokio::time::Instant::now() < deadline, "the permits came back as the work ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            started.load(std::sync::atomic::Ordering::SeqCst),
            MAX_OFF_RUNTIME_WORK,
            "the requests dropped while waiting never handed their work over"
        );
    }

    /// A large body's parse waits for its turn on the blocking pool no longer than for its
    /// room: the KV term's render deadline bounds the wait.
    #[tokio::test(start_paused = true)]
    async fn a_tree_waits_for_its_turn_on_the_blocking_pool_only_so_long() {
        let _filling = crate::memory::FILLING.lock().await;
        let content = "x".repeat(ON_THE_RUNTIME_BYTES);
        let request = parse(&format!(r#"{{"model":"m","messages":[{{"content":"{content}"}}]}}"#)).unwrap();
        let turns = OFF_RUNTIME.acquire_many(MAX_OFF_RUNTIME_WORK as u32).await.unwrap();
        let waited = tokio::time::Instant::now();
        let tree = request.tree_within(Duration::from_millis(100)).await;
        assert!(matches!(tree, Err(RequestError::Busy)), "{tree:?}");
        assert!(waited.elapsed() <= Duration::from_millis(150), "{:?}", waited.elapsed());
        drop(turns);
        assert!(request.tree_within(Duration::from_millis(100)).await.is_ok(), "a turn again");
    }

    /// With no room to add the rendered tokens, a body without `nvext` goes as the client sent
    /// it (the frontend tokenizes it itself); one with routing fields to strip cannot.
    #[tokio::test(start_paused = true)]
    async fn without_room_a_body_with_nothing_to_strip_goes_without_its_tokens() {
        let _filling = crate::memory::FILLING.lock().await;
        let room = SMALL_TREES.acquire_many(MAX_SMALL_TREE_BYTES_IN_FLIGHT as u32).await.unwrap();
        let plain = parse(r#"{"model":"m","messages":[{"content":"hi"}]}"#).unwrap();
        assert_eq!(plain.outbound(Some(vec![1, 2]), false).await.unwrap().into_bytes(), plain.raw);
        let routed = parse(r#"{"model":"m","messages":[{"content":"hi"}],"nvext":{"backend_instance_id":7}}"#).unwrap();
        assert!(matches!(routed.outbound(Some(vec![1, 2]), false).await, Err(RequestError::Busy)));
        drop(room);
        let with_tokens = plain.outbound(Some(vec![1, 2]), false).await.unwrap();
        assert!(with_tokens.ends_with(br#""nvext":{"token_data":[1,2]}}"#), "{with_tokens:?}");
    }

    /// A body rewritten to carry the router's tokens keeps the client's numbers as they were:
    /// floats to the last digit (the sampling parameters, a tool's schema), and member order.
    #[tokio::test]
    async fn a_rewritten_body_keeps_the_clients_numbers() {
        let text = r#"{"model":"m","messages":[{"content":"hi"}],"temperature":0.30000000000000004,"top_p":0.9,"seed":18446744073709551615,"logit_bias":{"5":-2.5e-300}}"#;
        let request = parse(text).unwrap();
        let out = request.outbound(Some(vec![1]), false).await.unwrap();
        let sent = text.strip_suffix('}').unwrap_or(text);
        assert_eq!(String::from_utf8_lossy(&out), format!(r#"{sent},"nvext":{{"token_data":[1]}}}}"#));
    }

    /// A rewrite may not grow a body past twice its size: numbers in exponent form are written
    /// out in full, and the copy is held beside the charged body for the whole dispatch.
    #[tokio::test]
    async fn a_rewrite_that_would_more_than_double_the_body_is_refused() {
        let numbers = |n: usize| vec!["1e15"; n].join(",");
        let text = format!(r#"{{"model":"m","messages":[{{"content":"hi"}}],"nvext":{{}},"pad":[{}]}}"#, numbers(1000));
        let refused = parse(&text).unwrap().outbound(None, false).await;
        assert!(matches!(refused, Err(RequestError::Grows { bytes }) if bytes > 2 * text.len()), "{refused:?}");
        let few = format!(r#"{{"model":"m","messages":[{{"content":"hi"}}],"nvext":{{}},"pad":[{}]}}"#, numbers(2));
        assert!(parse(&few).unwrap().outbound(None, false).await.is_ok(), "a body that grows a little goes");
    }

    /// An engine's own routing fields go nowhere: vLLM's `kv_transfer_params` would have a
    /// unified vLLM backend pull the prompt's KV from a host the client names.
    #[tokio::test]
    async fn an_engines_own_routing_fields_are_stripped() {
        let text = r#"{"model":"m","messages":[{"content":"hi"}],"kv_transfer_params":{"remote_host":"10.0.0.9","remote_port":5600},"disaggregated_params":{"request_type":"generation_only","ctx_request_id":7},"bootstrap_host":"x","bootstrap_port":1,"bootstrap_room":2,"bootstrap_pair_key":"k","routed_dp_rank":1,"disagg_prefill_dp_rank":0,"data_parallel_rank":1,"top_p":0.9}"#;
        let request = parse(text).unwrap();
        let out = request.outbound(None, false).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out), r#"{"model":"m","messages":[{"content":"hi"}],"top_p":0.9}"#);
    }

    /// A body of megabytes is read on the blocking pool, and read the same.
    #[tokio::test]
    async fn a_large_body_is_read_as_a_small_one_is() {
        let content = "word ".repeat(200_000);
        let text = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}],"stream":true}}"#);
        let read = ChatRequest::read(Bytes::from(text.clone())).await.unwrap();
        let parsed = parse(&text).unwrap();
        assert_eq!(
            (read.model, read.stream, read.prompt_estimate),
            (parsed.model, parsed.stream, parsed.prompt_estimate)
        );
        let refused = ChatRequest::read(Bytes::from(format!("[{}]", "1,".repeat(100_000) + "1"))).await;
        assert!(matches!(refused, Err(RequestError::Shape(_))), "{refused:?}");
    }

    /// Duplicate keys cannot smuggle a routing field past the strip: a key twice in one object,
    /// at the top or inside `nvext`, escaped or not, is refused at the ingress.
    #[test]
    fn duplicate_keys_smuggle_no_routing_field() {
        let twice = r#"{"model":"m","messages":[{"content":"hi"}],"nvext":{},"nvext":{"backend_instance_id":7}}"#;
        assert!(parse(twice).is_err_and(|e| e.contains("`nvext` twice")), "{:?}", parse(twice).err());
        let escaped =
            r#"{"model":"m","messages":[{"content":"hi"}],"nvext":{"a":1},"nv\u0065xt":{"backend_instance_id":7}}"#;
        assert!(parse(escaped).is_err(), "an escaped name is the same name");
        let repeated = r#"{"model":"m","messages":[{"content":"hi"}],"nvext":{"backend_instance_id":7,"greed":1,"backend_instance_id":8}}"#;
        assert!(parse(repeated).is_err_and(|e| e.contains("`backend_instance_id` twice")));
    }

    #[tokio::test]
    async fn the_tenant_salts_the_prompt_over_the_bodys_salt() {
        let request = parse(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"top"}"#).unwrap();
        let body = request.tree().await.unwrap();
        assert_eq!(request.cache_salt(&body), Some("top"));
        let tenant = request.clone().with_tenant(Some("tenant-a".into()));
        assert_eq!(tenant.cache_salt(&body), Some("tenant-a"));
        assert_eq!(
            tenant.outbound(None, false).await.unwrap().into_bytes(),
            request.raw,
            "the tenant goes as a header, the body as sent"
        );
    }

    #[tokio::test]
    async fn a_body_without_routing_fields_goes_out_byte_for_byte() {
        // Spacing and member order as the client wrote them: nothing was re-serialized.
        let text = r#"{ "messages": [{"role":"user","content":"hi"}],  "model":"m", "nvext_like": 1 }"#;
        let request = parse(text).unwrap();
        assert_eq!(&*request.outbound(None, false).await.unwrap(), text.as_bytes());
    }

    #[tokio::test]
    async fn a_body_with_nvext_goes_out_stripped_and_with_token_data_when_given() {
        let text = r#"{"model":"m","messages":[{}],"nvext":{"backend_instance_id":7,"token_data":[9],"extra_fields":["worker_id"]}}"#;
        let request = parse(text).unwrap();
        let out: Value = serde_json::from_slice(&request.outbound(None, true).await.unwrap()).unwrap();
        assert_eq!(out["nvext"], serde_json::json!({"extra_fields": ["worker_id"]}), "asked with x-backend");
        let out: Value = serde_json::from_slice(&request.outbound(None, false).await.unwrap()).unwrap();
        assert!(out.get("nvext").is_none(), "no echo of the pins for a client that did not ask: {out}");
        let out: Value = serde_json::from_slice(&request.outbound(Some(vec![1, 2]), true).await.unwrap()).unwrap();
        assert_eq!(out["nvext"]["token_data"], serde_json::json!([1, 2]), "the router's tokens, not the client's");
        // Escaped member names are names all the same.
        let escaped = parse(r#"{"model":"m","messages":[{}],"nv\u0065xt":{"backend_instance_id":7}}"#).unwrap();
        let out: Value = serde_json::from_slice(&escaped.outbound(None, false).await.unwrap()).unwrap();
        assert!(out.get("nvext").is_none(), "{out}");
        let plain = parse(r#"{"model":"m","messages":[{}]}"#).unwrap();
        let out: Value = serde_json::from_slice(&plain.outbound(Some(vec![3]), false).await.unwrap()).unwrap();
        assert_eq!(out["nvext"]["token_data"], serde_json::json!([3]));
    }

    #[tokio::test]
    async fn trees_wait_for_room_under_the_budget() {
        let _filling = crate::memory::FILLING.lock().await;
        let large =
            parse(&format!(r#"{{"model":"m","messages":[{{}}],"pad":"{}"}}"#, "x".repeat(MAX_REQUEST_BODY_BYTES - 64)))
                .unwrap();
        let mut held = Vec::new();
        for _ in 0..MAX_TREE_BYTES_IN_FLIGHT / MAX_REQUEST_BODY_BYTES {
            held.push(large.tree().await.unwrap());
        }
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), large.tree()).await;
        assert!(waiting.is_err(), "a fifth large tree waits while four are held");
        held.pop();
        assert!(large.tree().await.is_ok(), "and is built once one is let go");
    }

    /// A caller's wait bounds the room (and the turn on the blocking pool), not the parse: a
    /// large body's, which takes a while on an idle machine too, is not cut short by it.
    #[tokio::test]
    async fn a_wait_for_a_tree_bounds_its_room_not_its_parse() {
        let _filling = crate::memory::FILLING.lock().await;
        let numbers = vec!["1"; (MAX_REQUEST_BODY_BYTES - 64) / 2].join(",");
        let large = parse(&format!(r#"{{"model":"m","messages":[{{}}],"pad":[{numbers}]}}"#)).unwrap();
        let tree = large.tree_within(Duration::from_micros(1)).await;
        assert!(tree.is_ok(), "room was free: the tree is built however long its parse takes");
        let mut held = vec![tree.unwrap()];
        while held.len() < MAX_TREE_BYTES_IN_FLIGHT / MAX_REQUEST_BODY_BYTES {
            held.push(large.tree().await.unwrap());
        }
        let busy = large.tree_within(Duration::from_millis(1)).await;
        assert!(matches!(busy, Err(RequestError::Busy)), "no room within the wait");
    }

    /// A large body's tree is built off the runtime, a small one's on it: the large parse is
    /// still under way when its future is first polled (the runtime's thread is free for other
    /// tasks meanwhile), the small one is done at once.
    #[tokio::test]
    async fn a_large_tree_is_built_without_holding_up_the_runtime() {
        use std::future::Future;
        use std::task::{Context, Waker};
        let first_poll_pending = |body: &ChatRequest| {
            let mut tree = std::pin::pin!(body.tree());
            tree.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending()
        };
        let small = parse(r#"{"model":"m","messages":[{"content":[0,0,0]}]}"#).unwrap();
        assert!(!first_poll_pending(&small), "a small body is parsed on the runtime, at once");

        let numbers = vec!["0"; (MAX_REQUEST_BODY_BYTES - 64) / 2].join(",");
        let large = parse(&format!(r#"{{"model":"m","messages":[{{"content":[{numbers}]}}]}}"#)).unwrap();
        assert!(first_poll_pending(&large), "a large body's parse is handed to the blocking pool");
        let tree = large.tree().await.unwrap();
        assert_eq!(tree["messages"][0]["content"].as_array().map(Vec::len), Some((MAX_REQUEST_BODY_BYTES - 64) / 2));
    }

    #[test]
    fn refuses_what_cannot_be_routed_and_says_why() {
        let rows = [
            ("{key}", "not valid JSON"),
            ("", "not valid JSON"),
            ("[1", "not valid JSON"),
            (r#"{"model":"m","messages":[{}]} trailing"#, "not valid JSON"),
            (r#"{"model":"m","model":"n","messages":[{}]}"#, "JSON is refused: an object holds the key `model` twice"),
            (r#"{"model":"m","messages":{}}"#, "`messages`"),
            (r#"{"model":"m","messages":"hi"}"#, "`messages`"),
            ("[1]", "must be a JSON object"),
            (r#"{"messages":[{}]}"#, "`model`"),
            (r#"{"model":"","messages":[{}]}"#, "`model`"),
            (r#"{"model":7,"messages":[{}]}"#, "`model`"),
            // Skipped unbuilt, whatever their size: not a tree of forty times the body.
            (r#"{"model":[0,[0,{"a":0}]],"messages":[{}]}"#, "`model`"),
            (r#"{"model":{"name":"m"},"messages":[{}]}"#, "`model`"),
            (r#"{"model":"m","messages":[{}],"stream":[true]}"#, "`stream`"),
            (r#"{"model":"m","messages":[{}],"stream":1}"#, "`stream`"),
            (r#"{"model":"m"}"#, "`messages`"),
            (r#"{"model":"m","messages":[]}"#, "`messages`"),
            (r#"{"model":"m","messages":[{}],"stream":"yes"}"#, "`stream`"),
            // A frontend reads an array as NvExt's fields in order: the fourth names a worker.
            (r#"{"model":"m","messages":[{}],"nvext":[null,null,null,7,[1,2]]}"#, "`nvext` must be an object"),
            (r#"{"model":"m","messages":[{}],"nvext":"7"}"#, "`nvext` must be an object"),
            (r#"{"model":"m","messages":[{}],"nvext":true}"#, "`nvext` must be an object"),
            // What the ingress skips is checked as strictly as the frontend reads it: strings and
            // numbers anywhere, and no key twice at the top or in `nvext`.
            (r#"{"model":"m","messages":[{}],"user":"\ud800"}"#, "not valid JSON"),
            (r#"{"model":"m","messages":[{}],"temperature":1e400}"#, "not valid JSON"),
            (
                r#"{"model":"m","messages":[{"content":[{"type":"image_url","image_url":{"url":"\udc00"}}]}]}"#,
                "not valid JSON",
            ),
            (r#"{"model":"m","messages":[{}],"nvext":{"a":"\ud800"}}"#, "not valid JSON"),
            (r#"{"model":"m","messages":[{}],"max_tokens":1,"max_tokens":4096}"#, "`max_tokens` twice"),
            (r#"{"model":"m","messages":[{}],"nvext":{"x":1,"x":2}}"#, "`x` twice"),
            (r#"{"model":"m","messages":[{"role":"user","content":"a","content":"b"}]}"#, "`content` twice"),
            (r#"{"model":"m","messages":[{}],"tools":[{"type":"function","type":"function"}]}"#, "`type` twice"),
            (r#"{"model":"m","messages":[{}],"a\u0062":1,"ab":2}"#, "`ab` twice"),
            // Typed objects beside the prompt, and a content part's media: the frontend's types
            // refuse a repeat there too.
            (
                r#"{"model":"m","messages":[{}],"stream_options":{"include_usage":true,"include_usage":false}}"#,
                "`include_usage` twice",
            ),
            (r#"{"model":"m","messages":[{}],"response_format":{"type":"text","type":"json_object"}}"#, "`type` twice"),
            (r#"{"model":"m","messages":[{}],"tool_choice":{"type":"function","type":"none"}}"#, "`type` twice"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a","url":"b"}}]}]}"#,
                "`url` twice",
            ),
        ];
        for (body, says) in rows {
            let error = parse(body).unwrap_err();
            assert!(error.contains(says), "{body}: {error}");
        }
        let bytes = Bytes::from_static(b"{\"model\":\"m\",\"messages\":[{}],\"user\":\"\xff\"}");
        assert!(ChatRequest::parse(bytes).is_err(), "a byte that is no UTF-8, in a member skipped");
        let many: Vec<String> = (0..100).map(|i| format!(r#""k{i}":{i}"#)).collect();
        let wide = format!(r#"{{"model":"m","messages":[{{}}],{},"k99":0}}"#, many.join(","));
        assert!(parse(&wide).unwrap_err().contains("`k99` twice"), "past the list, the set");
        // A free-form value keeps the last copy in the frontend too: not refused here, however
        // deep in a typed object it sits.
        let free = r#"{"model":"m","messages":[{}],"metadata":{"a":1,"a":2},"tools":[{"function":{"parameters":{"p":{"q":1,"q":2},"p":2}}}]}"#;
        assert!(parse(free).is_ok(), "{:?}", parse(free).err());
        assert!(parse(r#"{"model":"m","messages":[{}],"nvext":null}"#).is_ok(), "a null nvext chooses nothing");
        assert!(parse(r#"{"model":"m","messages":[{}],"nvext":{"a":[1]}}"#).is_ok());
    }
}
