//! The Fleet service's bearer-token check, run on a call's headers before its body is read.
//!
//! A unary call's message (a `FindMatches` of up to 4 MiB, some 32 MiB once decoded) is read
//! whole before its handler runs, so a check in the handler would let a caller without a token
//! hold that memory for as long as it kept the call open. The gate runs as an interceptor
//! instead: a refused call is answered from its headers alone.
//!
//! An admitted call carries the token it presented ([`Presented`]), so a Watch stream can be
//! ended when that token is retired ([`retired`]): rotating a leaked token out then locks the
//! holder out of the stream it opened with it, while honest replicas reconnect with theirs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::IntCounter;
use tokio::sync::watch;
use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::ConnectionLookups;
use crate::bearer::{self, Token};

/// What each call learns of its connection, the same over TLS or not: the listener makes one
/// per connection, and tonic hands it to every call made on it (the connection's
/// `ConnectInfo`).
#[derive(Clone, Debug, Default)]
pub struct FleetConnection {
    /// What the connection's lookups hold of the lookup budget.
    pub lookups: ConnectionLookups,
    /// Whether a call on it got past the gate: one that makes none within its window is closed
    /// by the listener (`crate::listen`), so that callers without the token cannot hold the
    /// listener's places by answering pings.
    pub admitted: CallAdmitted,
}

/// Set once a call on the connection is admitted.
#[derive(Clone, Debug, Default)]
pub struct CallAdmitted(Arc<AtomicBool>);

impl CallAdmitted {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What an admitted call presented as its bearer token (`None`: no `authorization`).
#[derive(Clone, Copy, Debug)]
pub struct Presented(pub Option<Token>);

/// Refuses every call (`UNAUTHENTICATED`) that does not present `authorization: Bearer
/// <token>` with one of the tokens, while there are any.
#[derive(Clone, Debug)]
pub struct Gate {
    pub tokens: watch::Receiver<Vec<Token>>,
    pub unauthenticated: IntCounter,
}

impl Gate {
    /// What a call whose `authorization` header is `authorization` presented, if it is
    /// admitted; counted and refused if not.
    pub fn admit(&self, authorization: Option<&[u8]>) -> Result<Presented, Status> {
        let presented = Token::presented(authorization);
        if !bearer::admits(&self.tokens.borrow(), presented.as_ref()) {
            self.unauthenticated.inc();
            return Err(Status::unauthenticated(
                "send authorization: Bearer <control_plane.token> (a replica's --control-plane-token)",
            ));
        }
        Ok(Presented(presented))
    }
}

impl Interceptor for Gate {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let presented = self.admit(request.metadata().get("authorization").map(|value| value.as_bytes()))?;
        if let Some(connection) = request.extensions().get::<FleetConnection>() {
            connection.admitted.set();
        }
        request.extensions_mut().insert(presented);
        Ok(request)
    }
}

/// Resolves once `tokens` no longer admit `presented`; never while they do, nor once nothing
/// can change them.
pub async fn retired(mut tokens: watch::Receiver<Vec<Token>>, presented: Option<Token>) {
    while bearer::admits(&tokens.borrow_and_update(), presented.as_ref()) {
        if tokens.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn gate(tokens: &[&str]) -> (Gate, watch::Sender<Vec<Token>>) {
        let (set, tokens) = watch::channel(tokens.iter().map(|t| Token::new(t)).collect());
        (Gate { tokens, unauthenticated: IntCounter::new("refused", "refused").expect("a valid counter") }, set)
    }

    fn call(gate: &mut Gate, authorization: Option<&'static str>) -> Result<Option<Token>, Status> {
        let mut request = Request::new(());
        if let Some(value) = authorization {
            request.metadata_mut().insert("authorization", value.parse().expect("ascii"));
        }
        let admitted = gate.call(request)?;
        Ok(admitted.extensions().get::<Presented>().expect("an admitted call says what it presented").0)
    }

    #[test]
    fn calls_are_admitted_by_their_headers_and_say_what_they_presented() {
        let (mut open, _set) = gate(&[]);
        assert!(call(&mut open, None).is_ok_and(|presented| presented.is_none()), "no token asked, none needed");

        let (mut closed, _set) = gate(&["new", "old"]);
        for authorization in [None, Some("Bearer guess"), Some("new")] {
            let refused = call(&mut closed, authorization).expect_err("refused");
            assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        }
        assert_eq!(closed.unauthenticated.get(), 3, "each refusal counted");
        for token in ["new", "old"] {
            let presented = call(&mut closed, Some(if token == "new" { "Bearer new" } else { "Bearer old" }));
            assert!(presented.is_ok_and(|p| p.is_some_and(|p| p.matches(&Token::new(token)))));
        }
    }

    #[tokio::test]
    async fn a_stream_is_retired_with_the_token_it_presented() {
        let (gate, set) = gate(&["first"]);
        let mut ended = Box::pin(retired(gate.tokens.clone(), Some(Token::new("first"))));
        assert!(futures::FutureExt::now_or_never(ended.as_mut()).is_none(), "admitted now");
        // A rotation keeps the old token beside the new one: the stream runs on.
        set.send_replace(vec![Token::new("second"), Token::new("first")]);
        assert!(futures::FutureExt::now_or_never(ended.as_mut()).is_none(), "the previous token is still accepted");
        set.send_replace(vec![Token::new("second")]);
        tokio::time::timeout(Duration::from_secs(5), ended).await.expect("retired once its token is dropped");

        // A stream opened while no token was asked is ended once one is.
        let (gate, set) = super::tests::gate(&[]);
        let ended = retired(gate.tokens.clone(), None);
        set.send_replace(vec![Token::new("now")]);
        tokio::time::timeout(Duration::from_secs(5), ended).await.expect("retired once a token is asked");
    }
}
