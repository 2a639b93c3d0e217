//! Compiles the `.proto` files with `protox` (pure Rust, no `protoc`) and keeps the encoded
//! descriptor set so the control plane can serve gRPC reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/continuum/fleet/v1/fleet.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("fleet_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    // Every message is judged from its wire bytes before it is decoded (src/codec.rs).
    tonic_prost_build::configure().codec_path("crate::codec::BoundedCodec").compile_fds(fds)?;
    Ok(())
}
