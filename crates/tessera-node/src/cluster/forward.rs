//! Forwarding a plain client's request to the node that serves it.

use std::collections::HashMap;
use std::time::Duration;

use tessera_cluster::agent::Agent;
use tessera_cluster::auth::{Login, LoginError, LoginTo};
use tessera_wire::{encode_command, parse_value, skip_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{CommandError, CommandResult};

/// A forwarded request follows at most this many `MOVED` answers.
const FORWARD_HOPS_MAX: usize = 3;

/// A plain client's requests relayed to the nodes that own them: one
/// connection per owner, opened on first use and logged in as a relay with
/// the cluster secret (the client was checked here; the owner runs what a
/// relay sends for the cluster, whatever its users are).
#[derive(Default)]
pub struct Forwarder {
    links: HashMap<String, (TcpStream, Vec<u8>)>,
}

impl Forwarder {
    /// Sends one encoded request to `address` and returns its encoded answer,
    /// following `MOVED` if the owner changed meanwhile.
    pub async fn forward(
        &mut self,
        agent: &Agent,
        mut address: String,
        request: &[u8],
    ) -> CommandResult<Vec<u8>> {
        for _ in 0..FORWARD_HOPS_MAX {
            let reply = self.forward_pipelined(agent, &address, request, 1).await?.pop().expect("one answer");
            match moved_to(&reply) {
                Some(next) => address = next,
                None => return Ok(reply),
            }
        }
        Err(CommandError::TryAgain(format!("the owner kept moving (last asked {address})")))
    }

    /// Sends `count` encoded requests to `address` in one write and returns
    /// their encoded answers, in order; a `MOVED` among them is an answer
    /// like any other. A link that fails is dropped, to be opened again by
    /// the next request.
    pub async fn forward_pipelined(
        &mut self,
        agent: &Agent,
        address: &str,
        requests: &[u8],
        count: usize,
    ) -> CommandResult<Vec<Vec<u8>>> {
        let answers = self.exchange(agent, address, requests, count).await;
        if answers.is_err() {
            self.links.remove(address);
        }
        answers
    }

    async fn exchange(
        &mut self,
        agent: &Agent,
        address: &str,
        requests: &[u8],
        count: usize,
    ) -> CommandResult<Vec<Vec<u8>>> {
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
            let config = agent.config();
            let login = Login::new(LoginTo::Relay, &config.cluster_id, &config.node.to_string());
            let refused = |error: LoginError| {
                CommandError::Other(format!("the owner {address} refused this node: {error}"))
            };
            let challenge = call(&mut link, &login.hello()).await.map_err(unreachable)?;
            let auth = login.auth(&config.secret, challenge).map_err(refused)?;
            Login::accepted(call(&mut link, &auth).await.map_err(unreachable)?).map_err(refused)?;
            self.links.insert(address.to_string(), link);
        }
        let link = self.links.get_mut(address).expect("inserted above");
        link.0.write_all(requests).await.map_err(unreachable)?;
        let mut answers = Vec::with_capacity(count);
        for _ in 0..count {
            answers.push(read_reply(link).await.map_err(unreachable)?);
        }
        Ok(answers)
    }
}

/// One command of the login, and its answer.
async fn call(link: &mut (TcpStream, Vec<u8>), args: &[Vec<u8>]) -> std::io::Result<Value> {
    let mut request = Vec::new();
    encode_command(args, &mut request);
    link.0.write_all(&request).await?;
    let reply = read_reply(link).await?;
    match parse_value(&reply) {
        Ok(Some((value, _))) => Ok(value),
        _ => Err(std::io::Error::other("a malformed answer to the login")),
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
