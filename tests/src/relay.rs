//! The least an HTTP/1.1 reverse proxy on tokio can do, as a floor for `bench-proxy`: each
//! client connection gets one upstream connection of its own, and each request's bytes go to it
//! as they came and its answer's bytes back as they came. No header is read beyond the
//! framing, nothing is picked, recorded or rewritten. What it costs against nginx is the
//! runtime's share of the data plane's cost; what the data plane costs beyond it is its work.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Headers a message may carry; more is refused.
const MAX_HEADERS: usize = 32;
/// What one connection's buffers start with.
const BUFFER: usize = 8 << 10;

/// A relay listening on a loopback port; stops accepting when dropped.
#[derive(Debug)]
pub struct Relay {
    pub addr: SocketAddr,
    _stop: DropGuard,
}

impl Relay {
    /// Listens on a fresh loopback port, on the current runtime, relaying to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                    () = stopped.cancelled() => return,
                };
                tokio::spawn(async move {
                    let _ = relay(client, upstream).await;
                });
            }
        });
        Ok(Self { addr, _stop: stop.drop_guard() })
    }
}

/// Relays one client connection's requests over one upstream connection until either closes.
async fn relay(mut client: TcpStream, upstream: SocketAddr) -> io::Result<()> {
    client.set_nodelay(true)?;
    let mut shim = TcpStream::connect(upstream).await?;
    shim.set_nodelay(true)?;
    let (mut asked, mut answered) = (Vec::with_capacity(BUFFER), Vec::with_capacity(BUFFER));
    loop {
        let Some(request) = read_message(&mut client, &mut asked, Kind::Request).await? else { return Ok(()) };
        shim.write_all(&asked[..request]).await?;
        asked.drain(..request);
        let Some(response) = read_message(&mut shim, &mut answered, Kind::Response).await? else { return Ok(()) };
        client.write_all(&answered[..response]).await?;
        answered.drain(..response);
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Request,
    Response,
}

/// Reads until `buffer` holds one whole message framed by `Content-Length`; its length, or
/// `None` when the peer closed between messages.
async fn read_message(stream: &mut TcpStream, buffer: &mut Vec<u8>, kind: Kind) -> io::Result<Option<usize>> {
    loop {
        if let Some(length) = framed_length(buffer, kind)?
            && buffer.len() >= length
        {
            return Ok(Some(length));
        }
        if stream.read_buf(buffer).await? == 0 {
            return if buffer.is_empty() { Ok(None) } else { Err(io::ErrorKind::UnexpectedEof.into()) };
        }
    }
}

/// The whole message's length once its head is in `buffer`: head plus `Content-Length`.
fn framed_length(buffer: &[u8], kind: Kind) -> io::Result<Option<usize>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let parsed = match kind {
        Kind::Request => httparse::Request::new(&mut headers).parse(buffer),
        Kind::Response => httparse::Response::new(&mut headers).parse(buffer),
    };
    let head = match parsed.map_err(io::Error::other)? {
        httparse::Status::Complete(head) => head,
        httparse::Status::Partial => return Ok(None),
    };
    let body = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(0);
    Ok(Some(head + body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_its_head_and_its_content_length() -> io::Result<()> {
        let request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: h\r\nContent-Length: 4\r\n\r\nbody";
        assert_eq!(framed_length(request, Kind::Request)?, Some(request.len()));
        assert_eq!(framed_length(&request[..20], Kind::Request)?, None, "a partial head is not framed yet");
        let response = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        assert_eq!(framed_length(response, Kind::Response)?, Some(response.len()));
        let empty = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(framed_length(empty, Kind::Response)?, Some(empty.len()), "no length, no body");
        Ok(())
    }

    #[tokio::test]
    async fn requests_and_answers_pass_through_unchanged() -> anyhow::Result<()> {
        let upstream = TcpListener::bind("127.0.0.1:0").await?;
        let upstream_addr = upstream.local_addr()?;
        let requests =
            ["POST / HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc", "POST /b HTTP/1.1\r\ncontent-length: 2\r\n\r\nhi"];
        let response = |answer: &str| format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{answer}", answer.len());
        let shim = tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await?;
            let mut buffer = Vec::new();
            for (request, answer) in requests.iter().zip(["one", "two"]) {
                let length = read_message(&mut conn, &mut buffer, Kind::Request).await?.unwrap_or_default();
                assert_eq!(&buffer[..length], request.as_bytes(), "the request as the client sent it");
                buffer.drain(..length);
                conn.write_all(response(answer).as_bytes()).await?;
            }
            anyhow::Ok(())
        });
        let relay = Relay::start(upstream_addr).await?;
        let mut client = TcpStream::connect(relay.addr).await?;
        let mut buffer = Vec::new();
        for (request, expected) in requests.iter().zip(["one", "two"]) {
            client.write_all(request.as_bytes()).await?;
            let length = read_message(&mut client, &mut buffer, Kind::Response).await?.unwrap_or_default();
            assert_eq!(&buffer[..length], response(expected).as_bytes(), "the answer as the upstream wrote it");
            buffer.drain(..length);
        }
        shim.await??;
        Ok(())
    }
}
