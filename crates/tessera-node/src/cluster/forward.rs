//! Forwarding a plain client's request to the node that serves it.

use std::collections::HashMap;
use std::time::Duration;

use tessera_wire::{encode_command, skip_value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{CommandError, CommandResult};

/// A forwarded request follows at most this many `MOVED` answers.
const FORWARD_HOPS_MAX: usize = 3;

/// A plain client's requests relayed to the nodes that own them: one
/// connection per owner, opened on first use.
pub struct Forwarder {
    links: HashMap<String, (TcpStream, Vec<u8>)>,
    /// The cluster's password, if its nodes require one (they share it).
    password: Option<String>,
}

impl Forwarder {
    pub fn new(password: Option<String>) -> Self {
        Self { links: HashMap::new(), password }
    }

    /// Sends one encoded request to `address` and returns its encoded answer,
    /// following `MOVED` if the owner changed meanwhile.
    pub async fn forward(&mut self, mut address: String, request: &[u8]) -> CommandResult<Vec<u8>> {
        for _ in 0..FORWARD_HOPS_MAX {
            let reply = self.exchange(&address, request).await.inspect_err(|_| {
                self.links.remove(&address);
            })?;
            match moved_to(&reply) {
                Some(next) => address = next,
                None => return Ok(reply),
            }
        }
        Err(CommandError::TryAgain(format!("the owner kept moving (last asked {address})")))
    }

    async fn exchange(&mut self, address: &str, request: &[u8]) -> CommandResult<Vec<u8>> {
        let unreachable = |error: std::io::Error| {
            CommandError::TryAgain(format!("cannot reach the owner {address}: {error}"))
        };
        if !self.links.contains_key(address) {
            let stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(address))
                .await
                .map_err(|_| unreachable(std::io::ErrorKind::TimedOut.into()))?
                .map_err(unreachable)?;
            let _ = stream.set_nodelay(true);
            let mut link = (stream, Vec::new());
            // A forwarded request must not be forwarded again: as a relay,
            // this link is told MOVED instead.
            let mut hello = Vec::new();
            if let Some(password) = &self.password {
                encode_command(&[b"AUTH".as_slice(), password.as_bytes()], &mut hello);
            }
            encode_command(&[b"CLUSTER".as_slice(), b"RELAY"], &mut hello);
            link.0.write_all(&hello).await.map_err(unreachable)?;
            for _ in 0..1 + usize::from(self.password.is_some()) {
                let reply = read_reply(&mut link).await.map_err(unreachable)?;
                if reply.first() == Some(&b'-') {
                    let message = String::from_utf8_lossy(&reply[1..]).trim_end().to_string();
                    return Err(CommandError::Other(format!(
                        "the owner {address} refused this node: {message}"
                    )));
                }
            }
            self.links.insert(address.to_string(), link);
        }
        let link = self.links.get_mut(address).expect("inserted above");
        link.0.write_all(request).await.map_err(unreachable)?;
        read_reply(link).await.map_err(unreachable)
    }
}

async fn read_reply((stream, buffer): &mut (TcpStream, Vec<u8>)) -> std::io::Result<Vec<u8>> {
    loop {
        match skip_value(buffer) {
            Ok(Some((end, _))) => return Ok(buffer.drain(..end).collect()),
            Ok(None) => {}
            Err(error) => return Err(std::io::Error::other(error.to_string())),
        }
        if stream.read_buf(buffer).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// The address in a `-MOVED slot address` answer.
fn moved_to(reply: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(reply.strip_prefix(b"-MOVED ")?).ok()?;
    let address = text.trim_end().split(' ').nth(1)?;
    Some(address.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moved_answers_name_the_new_owner() {
        assert_eq!(moved_to(b"-MOVED 3999 127.0.0.1:7002\r\n").as_deref(), Some("127.0.0.1:7002"));
        assert_eq!(moved_to(b"+OK\r\n"), None);
    }
}
