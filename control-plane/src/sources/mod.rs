//! Discovery sources that feed the fleet publisher. `static` needs no external service (the
//! embedded default and demos); etcd and Kubernetes sources live in `crate::discovery`.

pub mod etcd;
mod registry;
mod static_fleet;

pub use registry::{Generation, Registry};
pub use static_fleet::static_fleet;
