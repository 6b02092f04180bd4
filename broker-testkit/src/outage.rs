//! A database server that goes away and comes back, for the cases about outages: a TCP proxy in
//! front of the test server. [`Outage::cut`] closes every connection through it and closes its
//! port, so new connections are refused, as after a server crash on that host; [`Outage::restore`]
//! listens on the same port again. The server itself is never touched: other tests go on using
//! it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// A proxy to the server of a database URL (see the module docs).
pub struct Outage {
    /// Where the proxy listens.
    local: SocketAddr,
    /// The server.
    upstream: String,
    /// The accepting task, while the proxy is up.
    accept: Option<tokio::task::JoinHandle<()>>,
    /// Every connection through the proxy, cut with it.
    links: Arc<Mutex<JoinSet<()>>>,
}

impl Outage {
    /// A proxy in front of the server of `url` (a `postgres://` or `mysql://` URL with a host and
    /// a port), and the same URL pointed at the proxy.
    ///
    /// # Panics
    /// When the URL names no host or port, or no local port can be bound.
    pub async fn start(url: &str) -> (Self, String) {
        let mut parsed = url::Url::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let host = parsed
            .host_str()
            .unwrap_or_else(|| panic!("{url} names no host"))
            .to_owned();
        let port = parsed
            .port_or_known_default()
            .or_else(|| match parsed.scheme() {
                "postgres" | "postgresql" => Some(5432),
                "mysql" | "mariadb" => Some(3306),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{url} names no port"));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a local port for the proxy");
        let local = listener.local_addr().expect("the proxy's address");
        parsed
            .set_host(Some("127.0.0.1"))
            .expect("a server URL takes a host");
        parsed
            .set_port(Some(local.port()))
            .expect("a server URL takes a port");
        let mut outage = Self {
            local,
            upstream: format!("{host}:{port}"),
            accept: None,
            links: Arc::default(),
        };
        outage.serve(listener);
        (outage, parsed.into())
    }

    fn serve(&mut self, listener: TcpListener) {
        let upstream = self.upstream.clone();
        let links = self.links.clone();
        self.accept = Some(tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                links
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .spawn(async move {
                        let Ok(mut server) = TcpStream::connect(&upstream).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    });
            }
        }));
    }

    /// The server goes away: every connection through the proxy is closed, and its port
    /// refuses new ones until [`restore`](Self::restore).
    pub fn cut(&mut self) {
        if let Some(accept) = self.accept.take() {
            // Dropping the listener closes the port.
            accept.abort();
        }
        self.links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort_all();
    }

    /// The server is back: the proxy listens on its port again.
    ///
    /// # Panics
    /// When the port cannot be bound again (taken by another program meanwhile).
    pub async fn restore(&mut self) {
        if self.accept.is_some() {
            return;
        }
        // The aborted accept task may not have dropped its listener yet.
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(self.local).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot listen on {} again: {e}", self.local),
            }
        };
        self.serve(listener);
    }
}

impl Drop for Outage {
    fn drop(&mut self) {
        self.cut();
    }
}
