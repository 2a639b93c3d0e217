//! The simulated fleet's model files: the tiny model of the 1.6.1 captures (its tokenizer and
//! chat template), which every simulated worker's card names as `http://<shim>/artifacts/...`
//! and the simulated shim serves, as an operator's mirror would. A replica fetches them like
//! any card's artifacts: only once their checksums are pinned (the embedded default pins them).

use std::net::SocketAddr;

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use continuum_proto::model::{CheckedFile, ModelArtifacts, PromptDefaults};

/// A file of the card, as served and as pinned.
struct File {
    name: &'static str,
    bytes: &'static [u8],
    checksum: &'static str,
}

const TOKENIZER: File = File {
    name: "tokenizer.json",
    bytes: include_bytes!("../../../../tests/fixtures/dynamo-1.6.1/tinymodel/tokenizer.json"),
    checksum: "blake3:4b790d1231b2081593931289dcc9559ead3dd4d6df27357da278e0c93ec60884",
};
const TOKENIZER_CONFIG: File = File {
    name: "tokenizer_config.json",
    bytes: include_bytes!("../../../../tests/fixtures/dynamo-1.6.1/tinymodel/tokenizer_config.json"),
    checksum: "blake3:27b8fcaa163eb33d9b725dace88912192dd40899d37f80fa4343ea37539b4772",
};
const FILES: [&File; 2] = [&TOKENIZER, &TOKENIZER_CONFIG];

/// The checksums a configuration pins to let replicas load the simulated fleet's tokenizer.
#[cfg(test)]
fn checksums() -> impl Iterator<Item = &'static str> {
    FILES.iter().map(|file| file.checksum)
}

/// The card's artifacts, served by the shim at `shim`.
pub fn card(shim: SocketAddr) -> ModelArtifacts {
    let checked = |file: &File| CheckedFile {
        uri: format!("http://{shim}/artifacts/{}", file.name),
        checksum: file.checksum.to_owned(),
        size: file.bytes.len() as u64,
    };
    ModelArtifacts {
        tokenizer: Some(checked(&TOKENIZER)),
        tokenizer_config: Some(checked(&TOKENIZER_CONFIG)),
        chat_template: None,
        defaults: PromptDefaults::default(),
    }
}

/// `GET /artifacts/{name}`.
pub async fn serve(Path(name): Path<String>) -> Response {
    match FILES.iter().find(|file| file.name == name) {
        Some(file) => ([(header::CONTENT_TYPE, "application/json")], file.bytes).into_response(),
        None => (StatusCode::NOT_FOUND, "no such artifact\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_checksum_is_its_files_and_the_embedded_default_pins_them() {
        for file in FILES {
            assert_eq!(file.checksum, format!("blake3:{}", blake3::hash(file.bytes).to_hex()), "{}", file.name);
        }
        let pinned = crate::config::embedded_default().dynamo.kv.pinned_artifacts;
        assert_eq!(pinned, checksums().collect::<Vec<_>>());
    }
}
