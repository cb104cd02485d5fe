//! RESP framing, pure and synchronous over byte buffers: the connection layers
//! above decide when to read and write.
//!
//! - [`request`]: the server side parser of client commands, with a limit on
//!   everything a peer controls.
//! - [`reply`]: writes RESP2 or RESP3 replies into a buffer.
//! - [`value`]: parses any RESP2/RESP3 value (the client side).
//! - [`client`]: a blocking, pipelining client connection.

pub mod client;
pub mod prefix;
pub mod reply;
pub mod request;
pub mod slot;
pub mod value;

pub use client::{Client, ClientError};
pub use reply::{Protocol, ReplyWriter};
pub use request::{Limits, Parsed, ProtocolError, Request, RequestParser};
pub use value::{encode_command, parse_value, skip_value, Value};
