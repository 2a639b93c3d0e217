//! The open-file limit both binaries raise as they start.
//!
//! Every client connection, shim connection, subscription and replica stream is a descriptor,
//! and many hosts and container runtimes start a process with a soft limit of 1,024: far below
//! the 16,384 client connections a replica serves, or the 2,048 subscriptions a control plane
//! holds. The hard limit is the operator's to set; the soft one is the process's to raise to it,
//! as nginx does with `worker_rlimit_nofile`.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Raises the soft open-file limit to the hard one. Returns the soft limit in force afterwards
/// (`None`: unlimited), and why it could not be raised, if it could not.
pub fn raise_open_file_limit() -> (Option<u64>, Option<std::io::Error>) {
    let limit = getrlimit(Resource::Nofile);
    let mut refused = None;
    if limit.current != limit.maximum {
        let raised = Rlimit { current: limit.maximum, maximum: limit.maximum };
        refused = setrlimit(Resource::Nofile, raised).err().map(std::io::Error::from);
    }
    (getrlimit(Resource::Nofile).current, refused)
}
