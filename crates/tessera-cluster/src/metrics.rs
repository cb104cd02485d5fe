//! The Prometheus endpoint a node and a coordinator serve on `metrics-bind`
//! (docs/OPERATIONS.md, "Prometheus metrics").
//!
//! Nothing is counted for it: at each scrape a [`Collector`] reads the
//! figures the process already keeps and `prometheus-client` encodes them
//! in the OpenMetrics text format, served by [`crate::http`]; given a token,
//! only scrapes that carry it are answered.

use std::fmt;

use hyper::StatusCode;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::http::{not_found, respond, unauthorized, HttpEndpoint, HttpResponse};

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
}

impl HttpEndpoint for MetricsEndpoint {
    fn get(&self, path: &str, authorized: bool) -> HttpResponse {
        if path != "/metrics" {
            return not_found();
        }
        if !authorized {
            return unauthorized();
        }
        match self.render() {
            Ok(text) => respond(StatusCode::OK, OPENMETRICS, text),
            Err(_) => respond(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain; charset=utf-8",
                "the metrics could not be encoded\n",
            ),
        }
    }

    fn token(&self) -> Option<&[u8]> {
        self.token.as_deref()
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

    use crate::http::{load_token, serve, HEADER_BYTES_MAX};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::net::TcpListener;
    use tokio::sync::watch;

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
