//! The small HTTP listeners a node and a coordinator serve: Prometheus
//! metrics (`metrics-bind`) and the coordinator's dashboard
//! (`dashboard-bind`). Each is bounded like every other listener
//! (connections, header bytes, time to send a request, a connection's
//! lifetime) and checks a bearer token where it is given one.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Clients served at once; more wait in the accept queue.
const CONNECTIONS_MAX: usize = 16;
/// A request's head must arrive within this, and fit in this many bytes.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const HEADER_BYTES_MAX: usize = 16 * 1024;
/// A kept-alive connection is closed (after its request in flight) this
/// long after it opened; the client opens another.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Shortest token accepted: a guessable one protects nothing.
const TOKEN_BYTES_MIN: usize = 16;

pub type HttpResponse = Response<Full<Bytes>>;

/// What a listener answers.
pub trait HttpEndpoint: Send + Sync + 'static {
    /// The answer to a GET or HEAD of `path`; `authorized` when the request
    /// carried the endpoint's token (or the endpoint has none).
    fn get(&self, path: &str, authorized: bool) -> HttpResponse;
    /// The bearer token requests must carry for what needs one.
    fn token(&self) -> Option<&[u8]>;
}

/// A response of `status` with `body` of `content_type`.
pub fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> HttpResponse {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

pub fn not_found() -> HttpResponse {
    respond(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "not found\n")
}

pub fn unauthorized() -> HttpResponse {
    let mut response =
        respond(StatusCode::UNAUTHORIZED, "text/plain; charset=utf-8", "a bearer token is required\n");
    response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

fn answer(endpoint: &dyn HttpEndpoint, request: &Request<Incoming>) -> HttpResponse {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", "only GET\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let authorized = endpoint.token().is_none_or(|token| {
        let presented = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        bool::from(presented.ct_eq(token))
    });
    endpoint.get(request.uri().path(), authorized)
}

/// Reads a bearer token from `path`: its first line, which must be long
/// enough to be worth checking.
pub fn load_token(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path).map_err(|error| format!("{}: {error}", path.display()))?;
    let token = text.lines().next().unwrap_or_default().trim();
    if token.len() < TOKEN_BYTES_MIN {
        return Err(format!("{}: a token needs at least {TOKEN_BYTES_MIN} characters", path.display()));
    }
    Ok(token.as_bytes().to_vec())
}

/// Answers requests on `listener` until `stop` turns true.
pub async fn serve(listener: TcpListener, endpoint: Arc<dyn HttpEndpoint>, mut stop: watch::Receiver<bool>) {
    let permits = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        let Ok(permit) = permit else { return };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of descriptors, say: wait rather than spin.
                tracing::warn!(%error, "HTTP listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request| {
                let response = answer(endpoint.as_ref(), &request);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(HEADER_BYTES_MAX)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(HEADER_TIMEOUT, connection).await;
                }
            }
        });
    }
}
