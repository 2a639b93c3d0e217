//! Discovery sources that feed the fleet publisher. `static` needs no external service (the
//! embedded default and demos); etcd and Kubernetes sources live in `crate::discovery`.

mod static_fleet;

pub use static_fleet::static_workers;
