//! Discovery sources that feed the fleet publisher. `static` and `simulator` (the embedded
//! default's simulated fleet) need no external service; etcd and Kubernetes sources live in
//! `crate::discovery`.

pub mod etcd;
mod mixing;
mod registry;
pub mod reload;
pub mod simulator;
mod static_fleet;
mod supervisor;

pub use registry::{Generation, Registry};
pub use static_fleet::static_fleet;
pub use supervisor::{DiscoverySupervisor, STOP_GRACE, SourceError, SourceUnavailable};
