//! A blocking RESP client connection with pipelining. Used where a thread may
//! block: the `redis` engine's pool, the command line, and tests.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::value::{encode_command, parse_value, MalformedReply, Value};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Malformed(#[from] MalformedReply),
    #[error("connection closed by the server")]
    Closed,
}

pub struct Client {
    stream: TcpStream,
    read_buf: Vec<u8>,
    write_buf: Vec<u8>,
}

impl Client {
    /// Connects with a timeout that also bounds every later read and write.
    pub fn connect(address: impl ToSocketAddrs, timeout: Duration) -> Result<Self, ClientError> {
        let mut last_error = io::Error::new(io::ErrorKind::InvalidInput, "address resolved to nothing");
        for address in address.to_socket_addrs()? {
            match TcpStream::connect_timeout(&address, timeout) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    stream.set_read_timeout(Some(timeout))?;
                    stream.set_write_timeout(Some(timeout))?;
                    return Ok(Self {
                        stream,
                        read_buf: Vec::with_capacity(16 << 10),
                        write_buf: Vec::new(),
                    });
                }
                Err(error) => last_error = error,
            }
        }
        Err(last_error.into())
    }

    /// Sends one command and reads its reply. A server error comes back as
    /// `Ok(Value::Error)`.
    pub fn command<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<Value, ClientError> {
        self.write_buf.clear();
        encode_command(args, &mut self.write_buf);
        self.stream.write_all(&self.write_buf)?;
        self.read_value()
    }

    /// Sends every command in one write, then reads all the replies in order.
    pub fn pipeline<C: AsRef<[A]>, A: AsRef<[u8]>>(
        &mut self,
        commands: &[C],
    ) -> Result<Vec<Value>, ClientError> {
        self.write_buf.clear();
        for command in commands {
            encode_command(command.as_ref(), &mut self.write_buf);
        }
        self.stream.write_all(&self.write_buf)?;
        (0..commands.len()).map(|_| self.read_value()).collect()
    }

    /// Reads the next reply, skipping RESP3 push messages.
    pub fn read_value(&mut self) -> Result<Value, ClientError> {
        loop {
            if let Some((value, used)) = parse_value(&self.read_buf)? {
                self.read_buf.drain(..used);
                if matches!(value, Value::Push(_)) {
                    continue;
                }
                return Ok(value);
            }
            let filled = self.read_buf.len();
            self.read_buf.resize(filled + (64 << 10), 0);
            let read = self.stream.read(&mut self.read_buf[filled..]);
            let read = match read {
                Ok(read) => read,
                Err(error) => {
                    self.read_buf.truncate(filled);
                    return Err(error.into());
                }
            };
            self.read_buf.truncate(filled + read);
            if read == 0 {
                return Err(ClientError::Closed);
            }
        }
    }
}
