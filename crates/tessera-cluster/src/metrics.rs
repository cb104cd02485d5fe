//! The Prometheus endpoint a node and a coordinator serve on `metrics-bind`
//! (docs/OPERATIONS.md, "Prometheus metrics").
//!
//! Nothing is counted for it: at each scrape a [`Collector`] reads the
//! figures the process already keeps and `prometheus-client` encodes them
//! in the OpenMetrics text format. The listener is bounded like every other
//! (connections, header bytes, time to send a request, a connection's
//! lifetime) and, given a token, answers only requests that carry it as a
//! bearer token.

use std::convert::Infallible;
use std::fmt;
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
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Scrapers served at once; more wait in the accept queue.
const CONNECTIONS_MAX: usize = 16;
/// A request's head must arrive within this, and fit in this many bytes.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const HEADER_BYTES_MAX: usize = 16 * 1024;
/// A kept-alive connection is closed (after its request in flight) this
/// long after it opened; the scraper opens another.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Shortest token accepted: a guessable one protects nothing.
const TOKEN_BYTES_MIN: usize = 16;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the endpoint serves: a registry of collectors, and the token a
/// scrape must present (none: any scrape is answered).
pub struct MetricsEndpoint {
    registry: Registry,
    token: Option<Vec<u8>>,
}

impl MetricsEndpoint {
    pub fn new(collector: impl Collector, token: Option<Vec<u8>>) -> Self {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(collector));
        Self { registry, token }
    }

    /// The page a scrape gets.
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }

    fn answer(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        let reply = |status: StatusCode, body: &str| {
            let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
            *response.status_mut() = status;
            response
        };
        if request.uri().path() != "/metrics" {
            return reply(StatusCode::NOT_FOUND, "not found: the metrics are at /metrics\n");
        }
        if request.method() != Method::GET && request.method() != Method::HEAD {
            let mut response = reply(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
            response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return response;
        }
        if let Some(token) = &self.token {
            let presented = request
                .headers()
                .get(AUTHORIZATION)
                .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
                .unwrap_or_default();
            if !bool::from(presented.ct_eq(token)) {
                let mut response = reply(StatusCode::UNAUTHORIZED, "a bearer token is required\n");
                response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return response;
            }
        }
        match self.render() {
            Ok(text) => {
                let mut response = Response::new(Full::new(Bytes::from(text)));
                response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS));
                response
            }
            Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "the metrics could not be encoded\n"),
        }
    }
}

/// Reads a bearer token from `path`: its first line, which must be long
/// enough to be worth checking.
pub fn load_token(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path).map_err(|error| format!("{}: {error}", path.display()))?;
    let token = text.lines().next().unwrap_or_default().trim();
    if token.len() < TOKEN_BYTES_MIN {
        return Err(format!(
            "{}: a metrics token needs at least {TOKEN_BYTES_MIN} characters",
            path.display()
        ));
    }
    Ok(token.as_bytes().to_vec())
}

/// Answers scrapes on `listener` until `stop` turns true.
pub async fn serve(listener: TcpListener, endpoint: Arc<MetricsEndpoint>, mut stop: watch::Receiver<bool>) {
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
                tracing::warn!(%error, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request| {
                let response = endpoint.answer(&request);
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

/// A metric family without labels.
pub fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: impl EncodeGaugeValue,
) -> fmt::Result {
    encoder.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_gauge(&value)
}

/// A counter without labels; the encoder names it `<name>_total`.
pub fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: impl EncodeCounterValue,
) -> fmt::Result {
    encoder
        .encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<NoLabelSet, _, u64>(&value, None)
}

/// A gauge family, a value per label set.
pub fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in rows {
        family.encode_family(&labels)?.encode_gauge(&value)?;
    }
    Ok(())
}

/// A counter family, a value per label set.
pub fn counters<L: EncodeLabelSet, V: EncodeCounterValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in rows {
        family.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(&value, None)?;
    }
    Ok(())
}

/// One histogram of a family: its sum, and its buckets as (upper bound,
/// count in that bucket alone), the last bound infinite.
pub struct HistogramRow<L> {
    pub labels: L,
    pub sum: f64,
    pub buckets: Vec<(f64, u64)>,
}

/// A histogram family from counts kept elsewhere.
pub fn histograms<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = HistogramRow<L>>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for row in rows {
        debug_assert_eq!(row.buckets.last().map(|(bound, _)| *bound), Some(f64::INFINITY));
        let count = row.buckets.iter().map(|(_, count)| count).sum();
        family.encode_family(&row.labels)?.encode_histogram::<NoLabelSet>(
            row.sum,
            count,
            &row.buckets,
            None,
        )?;
    }
    Ok(())
}

/// Labels of one series, as name–value pairs.
pub type Labels = Vec<(&'static str, String)>;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed;

    impl Collector for Fixed {
        fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
            gauge(&mut encoder, "tessera_up", "Whether it runs.", 1)?;
            counters(
                &mut encoder,
                "tessera_calls",
                "Calls.",
                [(vec![("command", "get".to_string())], 7u64)],
            )?;
            histograms(
                &mut encoder,
                "tessera_seconds",
                "Time.",
                [HistogramRow {
                    labels: vec![("command", "get".to_string())],
                    sum: 0.5,
                    buckets: vec![(0.001, 2), (f64::INFINITY, 1)],
                }],
            )
        }
    }

    #[test]
    fn a_scrape_reads_the_collectors_in_the_openmetrics_text_format() {
        let text = MetricsEndpoint::new(Fixed, None).render().unwrap();
        assert!(text.contains("tessera_up 1\n"), "{text}");
        assert!(text.contains("tessera_calls_total{command=\"get\"} 7\n"), "{text}");
        assert!(text.contains("tessera_seconds_bucket{le=\"0.001\",command=\"get\"} 2\n"), "{text}");
        assert!(text.contains("tessera_seconds_bucket{le=\"+Inf\",command=\"get\"} 3\n"), "{text}");
        assert!(text.contains("tessera_seconds_count{command=\"get\"} 3\n"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_token_must_be_long_enough() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("token");
        std::fs::write(&path, "short\n").unwrap();
        assert!(load_token(&path).unwrap_err().contains("at least"));
        std::fs::write(&path, "0123456789abcdef0123\nignored").unwrap();
        assert_eq!(load_token(&path).unwrap(), b"0123456789abcdef0123");
        assert!(load_token(&directory.path().join("missing")).is_err());
    }

    /// Sends `request` to a running endpoint and returns what it answered.
    async fn exchange(address: std::net::SocketAddr, request: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[tokio::test]
    async fn the_endpoint_answers_only_scrapes_with_the_token_and_bounds_what_it_reads() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let token = b"0123456789abcdef0123".to_vec();
        let (stop, stopping) = watch::channel(false);
        let server =
            tokio::spawn(serve(listener, Arc::new(MetricsEndpoint::new(Fixed, Some(token))), stopping));
        let get = |path: &str, authorization: &str| {
            format!("GET {path} HTTP/1.1\r\nHost: x\r\n{authorization}Connection: close\r\n\r\n")
        };
        let scraped =
            exchange(address, get("/metrics", "Authorization: Bearer 0123456789abcdef0123\r\n").as_bytes())
                .await;
        assert!(scraped.starts_with("HTTP/1.1 200"), "{scraped}");
        assert!(scraped.contains(OPENMETRICS) && scraped.contains("tessera_up 1"), "{scraped}");
        for authorization in
            ["", "Authorization: Bearer 0123456789abcdef012X\r\n", "Authorization: Basic eDp5\r\n"]
        {
            let refused = exchange(address, get("/metrics", authorization).as_bytes()).await;
            assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
            assert!(!refused.contains("tessera_up"), "{refused}");
        }
        assert!(exchange(address, get("/", "").as_bytes()).await.starts_with("HTTP/1.1 404"));
        let post = "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        assert!(exchange(address, post.as_bytes()).await.starts_with("HTTP/1.1 405"));
        assert!(exchange(address, b"\x00\x01 not http at all\r\n\r\n").await.starts_with("HTTP/1.1 400"));
        let huge = format!("GET /metrics HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "a".repeat(4 * HEADER_BYTES_MAX));
        let answer = exchange(address, huge.as_bytes()).await;
        assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 431"), "{answer}");
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap();
    }
}
