//! The coordinator's web dashboard (`dashboard-bind`; docs/OPERATIONS.md,
//! "Dashboard"): one page, with no data in it, that reads `/api/state`
//! every second and draws the topology, the slot map, the tables and the
//! coordinator's decisions as they happen; and the cluster designer
//! (`/designer`), which lays a cluster out and writes the file `tessera
//! cluster up --config` starts. The API asks for the bearer
//! token; the page takes it from its URL's fragment (`#token=...`), which a
//! browser never sends to the server.

use hyper::StatusCode;

use crate::http::{not_found, respond, unauthorized, HttpEndpoint, HttpResponse};
use crate::server::CoordinatorObserver;

const PAGE: &str = include_str!("dashboard/index.html");
/// The cluster designer: a page of its own, with no data of the cluster's,
/// that writes a file `tessera cluster up --config` starts.
const DESIGNER: &str = include_str!("dashboard/designer.html");

pub struct DashboardEndpoint {
    observer: CoordinatorObserver,
    token: Option<Vec<u8>>,
}

impl DashboardEndpoint {
    pub fn new(observer: CoordinatorObserver, token: Option<Vec<u8>>) -> Self {
        Self { observer, token }
    }
}

impl HttpEndpoint for DashboardEndpoint {
    fn get(&self, path: &str, authorized: bool) -> HttpResponse {
        match path {
            "/" | "/index.html" => respond(StatusCode::OK, "text/html; charset=utf-8", PAGE),
            "/designer" => respond(StatusCode::OK, "text/html; charset=utf-8", DESIGNER),
            "/api/state" if authorized => respond(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec(&self.observer.dashboard_state()).unwrap_or_default(),
            ),
            "/api/state" => unauthorized(),
            _ => not_found(),
        }
    }

    fn token(&self) -> Option<&[u8]> {
        self.token.as_deref()
    }
}
