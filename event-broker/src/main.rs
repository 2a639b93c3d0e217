//! `continuum-event-broker`: runs inside the GPU cluster, dials out to the control plane's
//! event-bus listener and relays publisher ZMTP bytes for the streams it is commanded to open.
//! Not built yet: it says so and exits non-zero, so nothing mistakes it for a working broker.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!(
        "continuum-event-broker: not implemented yet. Subscribe to workers directly \
         (dynamo.load.transport: direct) until the event-bus tunnel lands."
    );
    ExitCode::from(2)
}
