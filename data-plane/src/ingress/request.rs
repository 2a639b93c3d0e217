//! The ingress phase's reading of a chat completion request: bounded, valid JSON, and just
//! enough of the OpenAI shape checked to route it. Everything else is the frontend's to judge.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use bytes::Bytes;
use serde_json::Value;

/// The largest request body accepted: long multi-turn prompts with inline images fit.
pub const MAX_REQUEST_BODY_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the request body is larger than {MAX_REQUEST_BODY_BYTES} bytes")]
    TooLarge,
    #[error("the request body could not be read: {0}")]
    Unreadable(#[source] BytesRejection),
    #[error("the request body is not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("{0}")]
    Shape(&'static str),
}

impl From<BytesRejection> for RequestError {
    fn from(rejection: BytesRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RequestError::TooLarge
        } else {
            RequestError::Unreadable(rejection)
        }
    }
}

/// A chat completion request as the client sent it; `body` keeps the client's model id.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub body: Value,
    pub model: String,
    pub stream: bool,
}

impl ChatRequest {
    pub fn parse(bytes: &Bytes) -> Result<Self, RequestError> {
        let body: Value = serde_json::from_slice(bytes).map_err(RequestError::Json)?;
        let object = body.as_object().ok_or(RequestError::Shape("the request body must be a JSON object"))?;
        let model = match object.get("model") {
            Some(Value::String(model)) if !model.is_empty() => model.clone(),
            _ => {
                return Err(RequestError::Shape(
                    "`model` must be a non-empty string naming a model from GET /v1/models",
                ));
            }
        };
        match object.get("messages") {
            Some(Value::Array(messages)) if !messages.is_empty() => {}
            _ => return Err(RequestError::Shape("`messages` must be a non-empty array of chat messages")),
        }
        let stream = match object.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(stream)) => *stream,
            Some(_) => return Err(RequestError::Shape("`stream` must be true or false")),
        };
        Ok(Self { body, model, stream })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ChatRequest, String> {
        ChatRequest::parse(&Bytes::from(text.to_string())).map_err(|e| e.to_string())
    }

    #[test]
    fn reads_model_and_stream_and_keeps_the_body_whole() {
        let request =
            parse(r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true,"nvext":{"x":1}}"#)
                .unwrap();
        assert_eq!((request.model.as_str(), request.stream), ("qwen", true));
        assert_eq!(request.body["nvext"]["x"], 1);
        assert!(!parse(r#"{"model":"m","messages":[{}],"stream":null}"#).unwrap().stream);
    }

    #[test]
    fn refuses_what_cannot_be_routed_and_says_why() {
        let rows = [
            ("{key}", "not valid JSON"),
            ("[1]", "must be a JSON object"),
            (r#"{"messages":[{}]}"#, "`model`"),
            (r#"{"model":"","messages":[{}]}"#, "`model`"),
            (r#"{"model":7,"messages":[{}]}"#, "`model`"),
            (r#"{"model":"m"}"#, "`messages`"),
            (r#"{"model":"m","messages":[]}"#, "`messages`"),
            (r#"{"model":"m","messages":[{}],"stream":"yes"}"#, "`stream`"),
        ];
        for (body, says) in rows {
            let error = parse(body).unwrap_err();
            assert!(error.contains(says), "{body}: {error}");
        }
    }
}
