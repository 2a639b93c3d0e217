//! Futures built in the box that holds them.
//!
//! A request's futures are kilobytes (the connection's reads, the dispatch's attempts), and a
//! future made and then boxed is built on the stack and copied whole into its box, as is one
//! handed up through each level that wraps it. The largest are boxed where they are made,
//! with the box taken first: the compiler then builds the future in it and copies nothing
//! (measured with callgrind on bench-proxy's request path; docs/benchmark-notes.md, session 69).

use std::pin::Pin;

/// The future `make` builds, built in a box of its own. `make` runs after the box is taken,
/// which is what lets the future be written straight into it.
#[inline(always)]
pub fn built_in_box<F: Future>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
