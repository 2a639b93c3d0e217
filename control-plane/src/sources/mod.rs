//! Discovery sources that feed the fleet publisher. `static` needs no external service (the
//! embedded default and demos); etcd and Kubernetes sources live in `crate::discovery`.

pub mod etcd;
mod registry;
pub mod reload;
mod static_fleet;
mod supervisor;

pub use registry::{Generation, Registry};
pub use static_fleet::static_fleet;
pub use supervisor::{DiscoverySupervisor, STOP_GRACE, SourceUnavailable};
