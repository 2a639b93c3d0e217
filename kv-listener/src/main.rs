//! `continuum-kv-listener`: runs near KV event sources and relays announced SSE KV-event
//! streams to the control plane with resume by event id. Not built yet: it says so and exits
//! non-zero, so nothing mistakes it for a working listener.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!(
        "continuum-kv-listener: not implemented yet. KV events are read from the workers' \
         kv-events publishers directly until the push role lands."
    );
    ExitCode::from(2)
}
