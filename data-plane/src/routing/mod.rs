//! Routing decisions for one request: what a client may not say about routing (`headers`) and
//! which Dynamo workers serve it (`picker`). Both are free of I/O; the ingress and dispatch
//! phases call them and own every effect.

pub mod headers;
pub mod picker;
