//! The control plane's gRPC server: `continuum.fleet.v1.Fleet`, `grpc.health.v1` and server
//! reflection in both `v1` and `v1alpha` (grpcurl 1.8.6 speaks only the latter). Every call
//! asks for `control_plane.token` but a health `Check` ([`open`]), and health checks and
//! snapshots in flight are bounded ([`bounded`]).

mod bounded;
mod gate;
mod lookup_budget;
mod open;
mod service;
mod session;
pub mod tls;
mod turns;

use std::time::Duration;

use continuum_proto::pb::fleet_server::FleetServer;
use continuum_proto::{MAX_FLEET_MESSAGE_BYTES, MAX_INBOUND_FLEET_MESSAGE_BYTES};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;

use crate::listen::Guard;

pub use bounded::{MAX_OPEN_CALLS, MAX_SNAPSHOT_CALLS};
pub use gate::{CallAdmitted, FleetConnection, Gate};
pub use lookup_budget::{
    Budgeted, ConnectionLookups, LookupBudget, MAX_LOOKUP_BYTES_IN_FLIGHT, MAX_LOOKUP_BYTES_PER_CONNECTION,
};
pub use service::{FleetService, HELLO_TIMEOUT, MAX_WATCH_SESSIONS, MAX_WATCH_STREAMS, Replicas};
pub use session::{REPLICA_QUEUE_CAPACITY, REPLICA_STALL_LIMIT, ReplicaStatus};
pub use tls::ServerTls;
pub use turns::MAX_TURN_MODELS;

/// HTTP/2 keepalive: a replica whose connection went half-open is noticed within about
/// interval + timeout, and its session (and memory) released.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Calls one connection may hold open at once: a replica holds its Watch stream and its
/// lookups in flight (a few dozen at thousands of requests a second, each within its
/// deadline). tonic would otherwise lift HTTP/2's limit altogether, and every call holds its
/// message's memory until it is answered.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// A call's handler must have its answer (its head, for a stream) within this: a lookup or a
/// snapshot whose request body stops short of its length would otherwise hold the call, and
/// the bytes it sent, for as long as its connection lives. Longer than [`HELLO_TIMEOUT`], which
/// a Watch handler waits at most before it answers with its stream.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// The largest message the health and reflection services read (a service or symbol name):
/// a health check asks for no credential, and tonic sets aside room for a message's declared
/// length as its header arrives, 4 MiB by default, which a call may then leave unfinished.
pub const MAX_UNAUTHENTICATED_MESSAGE_BYTES: usize = 16 << 10;

/// Streams one connection may make the server reset for the peer's protocol errors (hyper's
/// own default, which tonic lifts): past it the connection is closed, so a peer cannot
/// have stream after stream dispatched and reset at no cost to itself.
pub const MAX_LOCAL_ERROR_RESETS: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("building gRPC reflection from the embedded descriptors failed: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the Fleet service on `listener` until `shutdown` fires, over TLS when `tls` is given
/// (renewed as its files change, see [`tls`]).
pub async fn serve(
    (listener, guard): (TcpListener, Guard),
    fleet: FleetService,
    tls: Option<ServerTls>,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let (gate, lookups) = (fleet.gate(), fleet.lookup_budget());
    let snapshots_refused = fleet.calls_refused(bounded::SNAPSHOTS.label);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<FleetServer<FleetService>>().await;
    let health_service = bounded::Bounded::new(
        open::Open::new(health_service.max_decoding_message_size(MAX_UNAUTHENTICATED_MESSAGE_BYTES), gate.clone()),
        bounded::HEALTH_CHECKS,
        fleet.calls_refused(bounded::HEALTH_CHECKS.label),
    );
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(continuum_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    // A stream each, held for as long as its caller likes: for the token's holders only.
    let reflection_v1 = InterceptedService::new(
        reflection().build_v1()?.max_decoding_message_size(MAX_UNAUTHENTICATED_MESSAGE_BYTES),
        gate.clone(),
    );
    let reflection_v1alpha = InterceptedService::new(
        reflection().build_v1alpha()?.max_decoding_message_size(MAX_UNAUTHENTICATED_MESSAGE_BYTES),
        gate.clone(),
    );
    let router = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .timeout(CALL_TIMEOUT)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(bounded::Bounded::new(
            Budgeted::new(
                InterceptedService::new(
                    FleetServer::new(fleet)
                        .max_decoding_message_size(MAX_INBOUND_FLEET_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_FLEET_MESSAGE_BYTES),
                    gate,
                ),
                lookups,
            ),
            bounded::SNAPSHOTS,
            snapshots_refused,
        ));
    // Connections come through the listener's guard (see [`crate::listen`]), which also sets
    // TCP_NODELAY: `Server::tcp_nodelay` covers only the sockets `serve` binds itself, and Nagle
    // would hold a small FindMatches reply for the client's delayed ACK (~40 ms, twenty times
    // the lookup's 2 ms deadline).
    // A client watching the server's health hears that it goes, before its stream is cut.
    let stopping = {
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            health.set_not_serving::<FleetServer<FleetService>>().await;
            health.set_service_status("", ServingStatus::NotServing).await;
        }
    };
    match tls {
        Some(tls) => {
            let incoming = tls::incoming((listener, guard), &tls, shutdown.clone());
            router.serve_with_incoming_shutdown(incoming, stopping).await?;
        }
        None => {
            let incoming = futures::stream::unfold((listener, guard), |(listener, guard)| async move {
                let (stream, _) = guard.accept(&listener).await;
                Some((Ok::<_, std::io::Error>(stream), (listener, guard)))
            });
            router.serve_with_incoming_shutdown(incoming, stopping).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use continuum_proto::model::DataPlaneConfig;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    use super::*;
    use crate::fleet::FleetPublisher;
    use crate::metrics::Metrics;

    /// A service answering every call at once with a one-frame body, `fleet`.
    #[derive(Clone)]
    pub(crate) struct Answers;

    impl tower_service::Service<tonic::codegen::http::Request<tonic::body::Body>> for Answers {
        type Response = tonic::codegen::http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = futures::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
            let body = http_body_util::Full::new(bytes::Bytes::from_static(b"fleet"));
            futures::future::ready(Ok(tonic::codegen::http::Response::new(tonic::body::Body::new(body))))
        }
    }

    /// The gRPC status an answer carries in its head, if it is an error.
    pub(crate) fn code(answer: &tonic::codegen::http::Response<tonic::body::Body>) -> Option<tonic::Code> {
        tonic::Status::from_header_map(answer.headers()).map(|status| status.code())
    }

    /// A Fleet service on an empty fleet, its own metrics and cancel token.
    pub(crate) fn empty_fleet_service() -> anyhow::Result<(FleetService, Metrics, CancellationToken)> {
        let (metrics, cancel) = (Metrics::new()?, CancellationToken::new());
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        let service = FleetService::new(publisher, Replicas::default(), metrics.clone(), cancel.clone());
        Ok((service, metrics, cancel))
    }

    /// Serves `service` on a loopback port of its own, plaintext, until `cancel`; its URL.
    pub(crate) async fn serving(
        service: FleetService,
        metrics: &Metrics,
        cancel: &CancellationToken,
    ) -> anyhow::Result<String> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        tokio::spawn(serve((listener, Guard::fleet(metrics)), service, None, cancel.clone()));
        Ok(url)
    }

    /// With a token set, a health check is all a caller without it reaches: the health
    /// service's stream and reflection ask for the token as the Fleet calls do.
    #[tokio::test]
    async fn without_the_token_a_caller_reaches_only_the_health_check() -> anyhow::Result<()> {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::{ServerReflectionRequest, server_reflection_response::MessageResponse};

        let (service, metrics, cancel) = empty_fleet_service()?;
        let (_set, tokens) = tokio::sync::watch::channel(vec![crate::bearer::Token::new("s3cret")]);
        let url = serving(service.with_tokens(tokens), &metrics, &cancel).await?;
        let channel = tonic::transport::Channel::from_shared(url)?.connect().await?;
        let with_token = |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("authorization", "Bearer s3cret".parse().expect("ascii"));
            Ok(request)
        };

        let mut health = HealthClient::new(channel.clone());
        assert!(health.check(HealthCheckRequest { service: String::new() }).await.is_ok(), "probes need no token");
        let watch = health.watch(HealthCheckRequest { service: String::new() }).await;
        assert_eq!(watch.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::Unauthenticated));
        let mut health = HealthClient::with_interceptor(channel.clone(), with_token);
        assert!(
            health.watch(HealthCheckRequest { service: String::new() }).await.is_ok(),
            "the token's holder watches"
        );

        let list = || {
            let request = ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::ListServices(String::new())),
            };
            tokio_stream::iter([request])
        };
        let mut reflection = ServerReflectionClient::new(channel.clone());
        let refused = reflection.server_reflection_info(list()).await.map(|_| ()).map_err(|s| s.code());
        assert_eq!(refused, Err(tonic::Code::Unauthenticated));
        let mut reflection = ServerReflectionClient::with_interceptor(channel, with_token);
        let mut answers = reflection.server_reflection_info(list()).await?.into_inner();
        let answer = answers.message().await?.and_then(|a| a.message_response);
        assert!(matches!(answer, Some(MessageResponse::ListServicesResponse(_))), "{answer:?}");
        assert_eq!(metrics.unauthenticated.get(), 2, "each refusal counted");
        cancel.cancel();
        Ok(())
    }

    /// The services that ask for no credential read no message past a small bound: a caller
    /// cannot have the server set aside megabytes for a message it never finishes.
    #[tokio::test]
    async fn a_caller_without_a_credential_is_read_no_large_message() -> anyhow::Result<()> {
        let (service, metrics, cancel) = empty_fleet_service()?;
        let url = serving(service, &metrics, &cancel).await?;
        let mut client = HealthClient::new(tonic::transport::Channel::from_shared(url)?.connect().await?);
        let small = client.check(HealthCheckRequest { service: String::new() }).await;
        assert!(small.is_ok(), "{small:?}");
        let large = HealthCheckRequest { service: "a".repeat(MAX_UNAUTHENTICATED_MESSAGE_BYTES) };
        let refused = client.check(large).await.map(|_| ()).map_err(|status| status.code());
        assert_eq!(refused, Err(tonic::Code::OutOfRange));
        cancel.cancel();
        Ok(())
    }

    /// A connection's lookups are charged to its own share too, which the listener hands the
    /// call as the connection's `ConnectInfo`: past the share a lookup is refused as such while
    /// the process's budget has room, and a smaller one on the same connection still goes.
    /// Over TLS as over plaintext.
    #[tokio::test]
    async fn a_connections_lookups_hold_at_most_its_share_of_the_budget() -> anyhow::Result<()> {
        use continuum_proto::pb::fleet_client::FleetClient;
        use tonic::transport::{Certificate, Channel, ClientTlsConfig};

        let dir = tempfile::tempdir()?;
        let pair = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
        std::fs::write(dir.path().join("cert.pem"), pair.cert.pem())?;
        std::fs::write(dir.path().join("key.pem"), pair.signing_key.serialize_pem())?;
        for over_tls in [false, true] {
            let (service, metrics, cancel) = empty_fleet_service()?;
            let service = service.with_lookup_budget((64 << 10, 16 << 10));
            let channel = if over_tls {
                let paths = crate::config::ListenerTlsConfig {
                    cert: Some(dir.path().join("cert.pem")),
                    key: Some(crate::config::Secret::new(dir.path().join("key.pem").display().to_string())),
                    client_ca: None,
                };
                let tls = ServerTls::load(&paths, &metrics)?;
                let listener = TcpListener::bind("127.0.0.1:0").await?;
                let port = listener.local_addr()?.port();
                tokio::spawn(serve((listener, Guard::fleet(&metrics)), service, Some(tls), cancel.clone()));
                let roots = Certificate::from_pem(std::fs::read(dir.path().join("cert.pem"))?);
                let client_tls = ClientTlsConfig::new().ca_certificate(roots).domain_name("localhost");
                Channel::from_shared(format!("https://127.0.0.1:{port}"))?.tls_config(client_tls)?.connect().await?
            } else {
                Channel::from_shared(serving(service, &metrics, &cancel).await?)?.connect().await?
            };
            connection_share_holds(FleetClient::new(channel), &metrics).await?;
            cancel.cancel();
        }
        Ok(())
    }

    /// A lookup of `hashes` block hashes, each taking 9 bytes on the wire.
    fn lookup(hashes: u64) -> continuum_proto::pb::FindMatchesRequest {
        continuum_proto::pb::FindMatchesRequest {
            block_hashes: (0..hashes).map(|h| h | 1 << 62).collect(),
            model: "tiny".into(),
            ..Default::default()
        }
    }

    /// On `client`'s connection, served with a 64 KiB budget and 16 KiB shares.
    async fn connection_share_holds(
        mut client: continuum_proto::pb::fleet_client::FleetClient<tonic::transport::Channel>,
        metrics: &Metrics,
    ) -> anyhow::Result<()> {
        // Some 37 KiB: within the process's 64 KiB, past the connection's 16 KiB.
        let refused = client.find_matches(lookup(4096)).await.expect_err("past the connection's share");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains("one connection's calls hold"), "{}", refused.message());
        let counted = |result: &str| metrics.kv_find_matches.with_label_values(&[result]).get();
        assert_eq!((counted("over_connection_budget"), counted("over_budget")), (1, 0));
        let within = client.find_matches(lookup(64)).await.expect_err("the KV index is off");
        assert_eq!(within.code(), tonic::Code::FailedPrecondition, "{within:?}");
        Ok(())
    }

    /// Lookups are charged to the process's budget as their bytes arrive: one that would
    /// overdraw it is refused as such (not as a failed call), counted, and holds nothing after;
    /// one within it reaches the handler (which, the KV index off here, refuses it its way).
    #[tokio::test]
    async fn a_lookup_past_the_budget_is_refused_before_it_is_read_whole() -> anyhow::Result<()> {
        use continuum_proto::pb::fleet_client::FleetClient;

        let (service, metrics, cancel) = empty_fleet_service()?;
        let service = service.with_lookup_budget((16 << 10, 16 << 10));
        let budget = service.lookup_budget();
        let url = serving(service, &metrics, &cancel).await?;
        let mut client = FleetClient::new(tonic::transport::Channel::from_shared(url)?.connect().await?);
        let refused = client.find_matches(lookup(4096)).await.expect_err("past the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        let over_budget = metrics.kv_find_matches.with_label_values(&["over_budget"]);
        assert_eq!(over_budget.get(), 1);
        let within = client.find_matches(lookup(64)).await.expect_err("the KV index is off");
        assert_eq!(within.code(), tonic::Code::FailedPrecondition, "{within:?}");
        assert_eq!(over_budget.get(), 1);
        // The server lets go of a call's body as it answers; the client may hear first.
        for _ in 0..100 {
            if budget.held() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(budget.held(), 0, "both calls gave their bytes back");
        cancel.cancel();
        Ok(())
    }
}
