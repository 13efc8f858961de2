//! The error envelope on the answers hyper writes itself.
//!
//! A request hyper cannot parse (a malformed request line, a head past the
//! limit, two different `Content-Length`s) never reaches the app: hyper
//! answers it `400`, `431` or `414` with an empty body and closes the
//! connection, and offers no hook for that body. [`Enveloped`] wraps a
//! connection's IO and replaces exactly such an answer, as hyper hands it
//! over, with the same status and the error envelope. The app never
//! writes one: every answer of its own carries a JSON body.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use hyper::rt::{Read, ReadBufCursor, Write};
use protocol::error::ProtocolError;

/// A connection's IO whose automatic error answers carry the envelope.
pub struct Enveloped<T> {
    inner: T,
    /// The envelope answer still to write, from `written` on.
    pending: Vec<u8>,
    written: usize,
}

impl<T> Enveloped<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Enveloped {
            inner,
            pending: Vec::new(),
            written: 0,
        }
    }
}

/// The statuses hyper answers a request it cannot parse with, and what the
/// envelope says.
const AUTOMATIC: [(&[u8], &str); 3] = [
    (b"HTTP/1.1 400 ", "the request is not valid HTTP/1.1"),
    (b"HTTP/1.1 431 ", "the request head exceeds 32768 octets"),
    (b"HTTP/1.1 414 ", "the request target is too long"),
];

/// The envelope answer that replaces `head`, when `head` is exactly one of
/// hyper's automatic answers: its status line, no body, no content type.
fn replacement(head: &[u8]) -> Option<Vec<u8>> {
    let (line, message) = AUTOMATIC.iter().find(|(line, _)| head.starts_with(line))?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let fields = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
    if end != head.len()
        || !fields.contains("\r\ncontent-length: 0\r\n")
        || fields.contains("\r\ncontent-type:")
    {
        return None;
    }
    let status_line = &head[..head.windows(2).position(|w| w == b"\r\n")?];
    debug_assert!(status_line.starts_with(line));
    let body = ProtocolError::invalid_request(*message).to_body();
    let mut answer = status_line.to_vec();
    answer.extend_from_slice(
        format!(
            "\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    answer.extend_from_slice(&body);
    Some(answer)
}

impl<T: Write + Unpin> Enveloped<T> {
    /// Writes what is pending of a replacement; ready once nothing is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// Takes `buf` as written when it is an automatic answer, and writes
    /// its replacement instead (what does not go at once, at the next
    /// write, flush or shutdown).
    fn replaced(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Option<Poll<io::Result<usize>>> {
        let answer = replacement(buf)?;
        self.pending = answer;
        self.written = 0;
        Some(match self.poll_pending(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(buf.len())),
        })
    }
}

impl<T: Read + Unpin> Read for Enveloped<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Enveloped<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        if let Some(done) = self.replaced(cx, buf) {
            return done;
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        // An automatic answer is a head alone, in one slice.
        if let [head] = bufs
            && let Some(done) = self.replaced(cx, head)
        {
            return done;
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_automatic_answer_is_replaced() {
        let automatic = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Thu, 03 Dec 2026 13:00:00 GMT\r\n\r\n";
        let answer = String::from_utf8(replacement(automatic).unwrap()).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{answer}"
        );
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(body.contains("\"invalid_request\""), "{body}");
        // The app's own answers carry a body and a content type.
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(replacement(own), None);
        let with_body = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(replacement(with_body), None);
        let other = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(replacement(other), None);
        let partial = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n";
        assert_eq!(replacement(partial), None);
    }
}
