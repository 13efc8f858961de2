//! A client's link to the server node: request frames over a lossy
//! datagram link, resent byte for byte until answered.

use std::net::SocketAddr;
use std::time::Duration;

use madsim::net::Endpoint;
use madsim::time::sleep;

use crate::{MAX_FRAME, REQUEST, RESPONSE, SERVER, decode_response, encode_request};

/// One client's link to the server.
pub(crate) struct Link {
    ep: Endpoint,
    server: SocketAddr,
    next_id: u64,
    buf: Vec<u8>,
}

impl Link {
    /// A link from a new endpoint; request IDs start after `first_id`.
    pub(crate) async fn bind(first_id: u64) -> Link {
        Link::bind_to(first_id, SERVER).await
    }

    /// [`Link::bind`] to the server at `server`.
    pub(crate) async fn bind_to(first_id: u64, server: &str) -> Link {
        Link {
            ep: Endpoint::bind("0.0.0.0:0").await.expect("bind"),
            server: server.parse().expect("address"),
            next_id: first_id,
            buf: vec![0u8; MAX_FRAME],
        }
    }

    /// Sends `body` to endpoint `kind` (twice at once when `twice`) and
    /// returns every answer that arrives: the first, and the duplicate's if
    /// it comes soon after. Retries the identical bytes until answered.
    pub(crate) async fn call(
        &mut self,
        user: &str,
        kind: u8,
        body: &[u8],
        twice: bool,
        on_resend: &(dyn Fn() + Sync),
    ) -> Vec<(u16, Vec<u8>)> {
        let mut framed = vec![kind];
        framed.extend_from_slice(body);
        loop {
            let ids: Vec<u64> = (0..if twice { 2 } else { 1 })
                .map(|_| {
                    self.next_id += 1;
                    self.next_id
                })
                .collect();
            for id in &ids {
                let _ = self
                    .ep
                    .send_to(self.server, REQUEST, &encode_request(*id, user, &framed))
                    .await;
            }
            let mut answers = Vec::new();
            let deadline = sleep(Duration::from_millis(800));
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut deadline => break,
                    got = self.ep.recv_from(RESPONSE, &mut self.buf) => {
                        let Ok((n, _)) = got else { continue };
                        if let Some((id, status, b)) = decode_response(&self.buf[..n])
                            && ids.contains(&id)
                        {
                            answers.push((status, b));
                            if answers.len() == ids.len() {
                                break;
                            }
                            // The duplicate's answer may follow: wait a little for it.
                            deadline.as_mut().reset(madsim::time::Instant::now() + Duration::from_millis(300));
                        }
                    }
                }
            }
            if !answers.is_empty() {
                return answers;
            }
            on_resend();
        }
    }
}

/// A client request as the server's router reads it (`pull::route`): the
/// endpoint's byte, then the body.
pub(crate) fn framed(endpoint: client::Endpoint, body: &[u8]) -> Vec<u8> {
    let kind = match endpoint {
        client::Endpoint::Connect => 0u8,
        client::Endpoint::Push => 1,
        client::Endpoint::Pull => 2,
        client::Endpoint::Rebuild => 3,
    };
    let mut framed = vec![kind];
    framed.extend_from_slice(body);
    framed
}

/// A device's transport for `client::Client` over a [`Link`]: one try per
/// post, the first answer within 800 ms, else none (the client's own rules
/// retry).
pub(crate) struct ClientLink {
    link: Link,
    user: String,
}

impl ClientLink {
    /// A transport of `user` whose request IDs start after `first_id`.
    pub(crate) async fn bind(first_id: u64, user: &str) -> ClientLink {
        ClientLink {
            link: Link::bind(first_id).await,
            user: user.to_owned(),
        }
    }
}

impl client::Transport for ClientLink {
    async fn post(
        &mut self,
        endpoint: client::Endpoint,
        body: &[u8],
    ) -> Result<client::Answer, client::TransportError> {
        let framed = framed(endpoint, body);
        let link = &mut self.link;
        link.next_id += 1;
        let id = link.next_id;
        let frame = encode_request(id, &self.user, &framed);
        let _ = link.ep.send_to(link.server, REQUEST, &frame).await;
        let deadline = sleep(Duration::from_millis(800));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                biased;
                _ = &mut deadline => {
                    return Err(client::TransportError("no answer in time".into()));
                }
                got = link.ep.recv_from(RESPONSE, &mut link.buf) => {
                    let Ok((n, _)) = got else { continue };
                    if let Some((got_id, status, body)) = decode_response(&link.buf[..n])
                        && got_id == id
                    {
                        return Ok(client::Answer { status, retry_after: None, body });
                    }
                }
            }
        }
    }
}
