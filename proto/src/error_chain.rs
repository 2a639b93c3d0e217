//! Errors as operators read them: every cause, each said once.

/// An error and every cause under it. hyper's and tonic's own messages ("client error
/// (Connect)", "transport error") hide the cause, e.g. rustls's "invalid peer certificate:
/// UnknownIssuer"; the whole chain is what an operator needs.
///
/// A cause the message already says is not said again: many errors print their cause in
/// their own message too (thiserror's `{0}` beside `#[source]`, hyper's wrappers of a wrapper),
/// and "transport error: transport error: tcp connect error: tcp connect error" reads as noise.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !reason.contains(&text) {
            reason.push_str(": ");
            reason.push_str(&text);
        }
        source = cause.source();
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    /// An error: its message, and what caused it.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|cause| cause as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn every_cause_is_said_once() {
        let refused = Layer("Connection refused (os error 111)", None);
        let connect = Layer("tcp connect error", Some(Box::new(Layer("tcp connect error", Some(Box::new(refused))))));
        let transport = Layer("transport error", Some(Box::new(connect)));
        // As thiserror prints `Connect(#[source] e)` with `{0}` in its message.
        let session = Layer("cannot reach the control plane: transport error", Some(Box::new(transport)));
        assert_eq!(
            error_chain(&session),
            "cannot reach the control plane: transport error: tcp connect error: Connection refused (os error 111)"
        );
        let distinct = Layer("fetch failed", Some(Box::new(Layer("invalid peer certificate: UnknownIssuer", None))));
        assert_eq!(error_chain(&distinct), "fetch failed: invalid peer certificate: UnknownIssuer");
    }
}
