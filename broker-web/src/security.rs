//! Who may see the dashboard and which requests may change state: the Host check, the bearer
//! token (header or signed-in cookie) or the host application's hook, the CSRF check of every
//! POST, read-only mode, and the headers that keep the pages from being framed, cached or made
//! to run another origin's script.
//!
//! **Host.** A dashboard without authentication answers only to loopback host names (and those
//! it is given): otherwise a page on `attacker.example`, whose name the attacker points at
//! 127.0.0.1 after the page loaded (DNS rebinding), would be same-origin with the dashboard.
//!
//! **Sessions.** Signing in with the token sets a cookie `expiry.nonce.HMAC(secret, token,
//! expiry, nonce)`: it expires on the server as in the browser, and signing out revokes its
//! nonce. Failed sign-ins are limited for the whole dashboard (see [`LoginLimit`]).
//!
//! **CSRF.** The first response sets a random cookie (`HttpOnly`, `SameSite=Strict`); every form
//! carries `HMAC(secret, cookie, identity)` in a hidden field, where the identity is who is
//! signed in (the session's nonce, the bearer header, the hook's operator, or nobody). A POST is
//! refused before any handler runs when its field does not match its cookie and identity, when
//! it carries two CSRF cookies, or when the browser says it came from another origin
//! (`Sec-Fetch-Site`). A page on another port of the same host is same-site: it can plant a
//! CSRF cookie of its own with a narrower `Path` (which the browser sends first) and post a form
//! with a token it got from the public login page; that token was made for nobody, not for the
//! signed-in operator, so it does not verify. The secret is made when the dashboard is built,
//! so a token cannot be forged without it, nor carried from one dashboard to another.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, to_bytes};
use axum::extract::{NestedPath, OriginalUri, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::pages;
use crate::{Auth, Inner, Operator};

/// The form field of the CSRF token.
pub(crate) const CSRF_FIELD: &str = "csrf";
/// The largest form body read, in bytes (a page of ids is far below it).
const FORM_LIMIT: usize = 256 * 1024;
/// The shortest bearer token taken, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The cookies' names and attributes: `__Host-` names, `Secure` and `Path=/` when the
/// dashboard is served over HTTPS (the prefix makes the browser refuse such a cookie from a
/// plain-HTTP page or one scoped to a narrower path), plain names scoped to the mount path
/// otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cookies {
    pub(crate) secure: bool,
}

impl Cookies {
    pub(crate) fn auth(self) -> &'static str {
        if self.secure {
            "__Host-sqlx_broker_auth"
        } else {
            "sqlx_broker_auth"
        }
    }

    pub(crate) fn csrf(self) -> &'static str {
        if self.secure {
            "__Host-sqlx_broker_csrf"
        } else {
            "sqlx_broker_csrf"
        }
    }

    /// A `Set-Cookie` value for `name` under the dashboard mounted at `base`; `max_age`: none
    /// for a cookie that ends with the browser session, zero to delete it.
    pub(crate) fn set(
        self,
        name: &str,
        value: &str,
        base: &str,
        max_age: Option<Duration>,
    ) -> Option<HeaderValue> {
        let path = if self.secure || base.is_empty() {
            "/"
        } else {
            base
        };
        let mut v = format!("{name}={value}; Path={path}; HttpOnly; SameSite=Strict");
        if let Some(age) = max_age {
            v.push_str(&format!("; Max-Age={}", age.as_secs()));
        }
        if self.secure {
            v.push_str("; Secure");
        }
        HeaderValue::from_str(&v).ok()
    }

    /// Deletions of cookie `name` for every path the browser could have sent it for with a
    /// request to `full` (each prefix of it) but the dashboard's own, which the dashboard's
    /// `base` gives.
    pub(crate) fn delete_planted(self, name: &str, full: &str, base: &str) -> Vec<HeaderValue> {
        let own = if self.secure || base.is_empty() {
            "/"
        } else {
            base
        };
        let mut paths = vec!["/".to_owned()];
        let mut at = String::new();
        for seg in full.split('/').filter(|s| !s.is_empty()) {
            at.push('/');
            at.push_str(seg);
            paths.push(at.clone());
            paths.push(format!("{at}/"));
        }
        paths
            .into_iter()
            .filter(|p| p != own)
            .filter_map(|p| HeaderValue::from_str(&format!("{name}=; Path={p}; Max-Age=0")).ok())
            .collect()
    }
}

/// What every handler knows about its request.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    /// The path the dashboard is mounted at, without a trailing slash ("" at the root).
    pub(crate) base: String,
    /// The CSRF token for this request's forms.
    pub(crate) csrf: String,
    /// Who is operating, for `pause` (the hook's answer, or "dashboard").
    pub(crate) operator: String,
    /// No forms that change state.
    pub(crate) read_only: bool,
    /// The request comes with a signed-in session cookie (a Sign out button is shown).
    pub(crate) session: Option<Session>,
}

impl Ctx {
    /// The dashboard's path of `rest` (which starts with `/`).
    pub(crate) fn url(&self, rest: &str) -> String {
        format!("{}{rest}", self.base)
    }

    /// The queues page.
    pub(crate) fn home(&self) -> String {
        if self.base.is_empty() {
            "/".to_owned()
        } else {
            self.base.clone()
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8; 32], purpose: &str, value: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    m.update(purpose.as_bytes());
    m.update(b"\0");
    m.update(value);
    m
}

/// The hex HMAC of `value` for `purpose`.
pub(crate) fn sign(secret: &[u8; 32], purpose: &str, value: &[u8]) -> String {
    hex(&mac(secret, purpose, value).finalize().into_bytes())
}

/// Whether `presented` (hex) is the HMAC of `value` for `purpose`, compared in constant time.
pub(crate) fn verify(secret: &[u8; 32], purpose: &str, value: &[u8], presented: &str) -> bool {
    match unhex(presented) {
        Some(bytes) => mac(secret, purpose, value).verify_slice(&bytes).is_ok(),
        None => false,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// 32 random bytes from the operating system.
pub(crate) fn random() -> [u8; 32] {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the operating system's random source");
    b
}

/// Every value of cookie `name` in `headers`, in the order the browser sent them (the cookie
/// with the longest `Path` first).
pub(crate) fn cookies<'h>(headers: &'h HeaderMap, name: &str) -> Vec<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v)
        .collect()
}

/// The fields of a form body, in order.
pub(crate) fn form_fields(body: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(body).into_owned().collect()
}

/// Refuses a bearer token shorter than [`MIN_TOKEN_BYTES`]: an empty one would sign in anyone
/// at the login page, and a short one falls to guessing.
pub fn check_token(token: &str) -> Result<(), crate::DashboardError> {
    if token.len() < MIN_TOKEN_BYTES {
        return Err(crate::DashboardError::TokenTooShort { len: token.len() });
    }
    Ok(())
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A signed-in browser's session, read from its cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Session {
    /// Unix seconds after which the cookie is refused.
    pub(crate) expires: u64,
    /// Random, hex: names the session for the CSRF tokens and for signing out.
    pub(crate) nonce: String,
}

impl Session {
    fn signed(secret: &[u8; 32], token: &str, expires: u64, nonce: &str) -> String {
        sign(
            secret,
            "session",
            format!("{token}\0{expires}.{nonce}").as_bytes(),
        )
    }

    /// A new session of `lifetime` and its cookie value.
    pub(crate) fn start(secret: &[u8; 32], token: &str, lifetime: Duration) -> String {
        let expires = unix_secs().saturating_add(lifetime.as_secs());
        let nonce = hex(&random()[..16]);
        let mac = Self::signed(secret, token, expires, &nonce);
        format!("{expires}.{nonce}.{mac}")
    }

    /// The session a cookie value holds, if the dashboard made it and it has not expired.
    fn read(secret: &[u8; 32], token: &str, value: &str) -> Option<Session> {
        let mut parts = value.splitn(3, '.');
        let (expires, nonce, presented) = (parts.next()?, parts.next()?, parts.next()?);
        let expires: u64 = expires.parse().ok()?;
        let value = format!("{token}\0{expires}.{nonce}");
        if !verify(secret, "session", value.as_bytes(), presented) || expires <= unix_secs() {
            return None;
        }
        Some(Session {
            expires,
            nonce: nonce.to_owned(),
        })
    }
}

/// Sessions signed out before they expired, kept until they would have.
#[derive(Debug, Default)]
pub(crate) struct Revoked(Mutex<HashMap<String, u64>>);

impl Revoked {
    pub(crate) fn revoke(&self, s: &Session) {
        let now = unix_secs();
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, expires| *expires > now);
        m.insert(s.nonce.clone(), s.expires);
    }

    fn contains(&self, s: &Session) -> bool {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.contains_key(&s.nonce)
    }
}

/// At most [`LoginLimit::FAILURES`] failed sign-ins in any [`LoginLimit::WINDOW`], for the
/// whole dashboard; beyond that the login form answers 429 without looking at the token.
///
/// One limit for every client rather than one per address: behind a proxy every client has
/// the proxy's address, a header naming the client's (`X-Forwarded-For`) is whatever the client
/// writes, and an attacker with many addresses would get a budget per address. A failing
/// guesser can keep the form closed; bearer-header requests and signed-in browsers go on
/// working meanwhile.
#[derive(Debug, Default)]
pub(crate) struct LoginLimit(Mutex<VecDeque<Instant>>);

impl LoginLimit {
    pub(crate) const FAILURES: usize = 10;
    pub(crate) const WINDOW: Duration = Duration::from_secs(60);

    /// `None` when a sign-in may be tried now, or how long until one may.
    pub(crate) fn wait(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while f
            .front()
            .is_some_and(|t| now.duration_since(*t) >= Self::WINDOW)
        {
            f.pop_front();
        }
        (f.len() >= Self::FAILURES).then(|| {
            let oldest = f.front().copied().unwrap_or(now);
            Self::WINDOW.saturating_sub(now.duration_since(oldest))
        })
    }

    pub(crate) fn failed(&self) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.push_back(Instant::now());
        if f.len() > Self::FAILURES {
            f.pop_front();
        }
    }
}

/// Who a request comes from, as far as the CSRF tokens are concerned.
fn identity(auth: &Who) -> String {
    match auth {
        Who::Nobody => "nobody".to_owned(),
        Who::BearerHeader => "bearer".to_owned(),
        Who::Session(s) => format!("session:{}", s.nonce),
        Who::Operator(name) => format!("operator:{name}"),
    }
}

/// Who a request comes from.
enum Who {
    Nobody,
    BearerHeader,
    Session(Session),
    Operator(String),
}

/// What a CSRF token signs: the browser's CSRF cookie and who is signed in.
fn csrf_value(csrf_cookie: &str, who: &Who) -> Vec<u8> {
    format!("{csrf_cookie}\0{}", identity(who)).into_bytes()
}

/// The CSRF token of a form for cookie `csrf_cookie` and identity `who`.
fn csrf_token(secret: &[u8; 32], csrf_cookie: &str, who: &Who) -> String {
    sign(secret, "csrf", &csrf_value(csrf_cookie, who))
}

/// The host name a request names (`Host`, or the authority of an HTTP/2 request), lowercase,
/// without port, brackets or trailing dot.
fn host_name(parts: &Parts) -> Option<String> {
    let raw = match parts.headers.get(header::HOST) {
        Some(v) => v.to_str().ok()?,
        None => parts.uri.authority()?.as_str(),
    };
    let name = if let Some(rest) = raw.strip_prefix('[') {
        rest.split_once(']')?.0
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
    };
    Some(name.trim_end_matches('.').to_ascii_lowercase())
}

/// Whether `name` can only mean this machine: `localhost` (and its subdomains, which browsers
/// resolve to loopback themselves), 127.0.0.0/8, `::1`.
pub(crate) fn is_loopback_name(name: &str) -> bool {
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    match name.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Ok(ip) => ip.is_loopback(),
        Err(_) => false,
    }
}

/// `None` when the request's host may be served, or the refusal.
fn check_host(d: &Inner, parts: &Parts) -> Option<Response> {
    let open = matches!(d.auth, Auth::None);
    if !open && d.allowed_hosts.is_empty() {
        return None;
    }
    let name = host_name(parts);
    if name
        .as_deref()
        .is_some_and(|n| is_loopback_name(n) || d.allowed_hosts.iter().any(|a| a == n))
    {
        return None;
    }
    let named: String = name
        .as_deref()
        .unwrap_or("no host")
        .chars()
        .take(100)
        .collect();
    let why = if open {
        "this dashboard has no authentication, so it answers only to loopback host names (localhost, 127.0.0.1, [::1]) and the names it is given"
    } else {
        "this dashboard answers only to loopback host names (localhost, 127.0.0.1, [::1]) and the names it is given"
    };
    Some(pages::refusal(
        StatusCode::FORBIDDEN,
        &format!(
            "refused: {why}, and this request named \"{named}\". If that is this dashboard's name, add it with Dashboard::allowed_hosts (sqlx-broker web --allowed-host {named}){}",
            if open {
                ", or give the dashboard a token"
            } else {
                ""
            }
        ),
    ))
}

/// Whether the browser says a request came from a page of another origin. A browser sends
/// `Sec-Fetch-Site` with every request (Chromium 76, Firefox 90, Safari 16.4 and later); a
/// client that does not send it is left to the CSRF token.
fn cross_origin(headers: &HeaderMap) -> Option<String> {
    let site = headers.get("sec-fetch-site")?.to_str().unwrap_or("?");
    (!matches!(site, "same-origin" | "none")).then(|| site.to_owned())
}

/// The middleware in front of every route.
pub(crate) async fn guard(State(d): State<Arc<Inner>>, req: Request, next: Next) -> Response {
    let base = req
        .extensions()
        .get::<NestedPath>()
        .map(|p| p.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default();
    let path = req.uri().path().to_owned();
    let public = path.starts_with("/assets/") || path == "/login";
    let names = d.cookies;

    let (mut parts, body) = req.into_parts();
    if let Some(refused) = check_host(&d, &parts) {
        return security_headers(refused);
    }
    // Who is asking.
    let who = match &d.auth {
        Auth::Hook(hook) => match hook(&parts) {
            Some(Operator(name)) => Who::Operator(name),
            None => {
                return security_headers(pages::refusal(
                    StatusCode::FORBIDDEN,
                    "not allowed: the host application's authorization refused this request",
                ));
            }
        },
        Auth::Bearer(token) => {
            let header_ok = parts
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .is_some_and(|t| {
                    verify(
                        &d.secret,
                        "bearer",
                        t.trim().as_bytes(),
                        &sign(&d.secret, "bearer", token.as_bytes()),
                    )
                });
            // Any one valid session cookie signs the browser in: one planted beside it is
            // no session of the dashboard's and does not verify.
            let session = cookies(&parts.headers, names.auth())
                .into_iter()
                .filter_map(|c| Session::read(&d.secret, token, c))
                .find(|s| !d.revoked.contains(s));
            match (header_ok, session) {
                (true, _) => Who::BearerHeader,
                (false, Some(s)) => Who::Session(s),
                (false, None) if public => Who::Nobody,
                (false, None) => {
                    let login = format!("{base}/login");
                    return security_headers(if parts.method == Method::GET {
                        Redirect::to(&login).into_response()
                    } else {
                        let mut r = pages::refusal(
                            StatusCode::UNAUTHORIZED,
                            "not signed in (or the session expired): send Authorization: Bearer <token>, or sign in at the login page",
                        );
                        r.headers_mut()
                            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                        r
                    });
                }
            }
        }
        Auth::None => Who::Nobody,
    };

    // The CSRF cookie: this request's, or a new one that the response sets. Two of them mean
    // another site on this host planted one: the response deletes the planted ones and sets a
    // new one of the dashboard's, so the next page works again.
    let sent = cookies(&parts.headers, names.csrf());
    let planted = (sent.len() > 1).then(|| {
        let full = parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| format!("{base}{path}"), |u| u.path().to_owned());
        names.delete_planted(names.csrf(), &full, &base)
    });
    let (csrf_cookie, new_cookie) = match sent.first() {
        Some(c)
            if planted.is_none() && c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            ((*c).to_owned(), false)
        }
        _ => (hex(&random()), true),
    };
    let set_cookies = |r: &mut Response| {
        let h = r.headers_mut();
        for v in planted.iter().flatten() {
            h.append(header::SET_COOKIE, v.clone());
        }
        if new_cookie && let Some(v) = names.set(names.csrf(), &csrf_cookie, &base, None) {
            h.append(header::SET_COOKIE, v);
        }
    };
    let ctx = Ctx {
        base: base.clone(),
        csrf: csrf_token(&d.secret, &csrf_cookie, &who),
        operator: match &who {
            Who::Operator(name) => name.clone(),
            _ => "dashboard".to_owned(),
        },
        read_only: d.read_only,
        session: match &who {
            Who::Session(s) => Some(s.clone()),
            _ => None,
        },
    };

    // A refusal from here on sets the cookies too: one that answers a planted cookie's POST
    // deletes it, so the operator's next form works.
    let refuse = |status: StatusCode, message: &str| {
        let mut r = pages::refusal(status, message);
        set_cookies(&mut r);
        security_headers(r)
    };
    let body = if parts.method == Method::POST {
        if d.read_only && path != "/login" && path != "/logout" {
            return refuse(StatusCode::FORBIDDEN, "refused: the dashboard is read-only");
        }
        if let Some(site) = cross_origin(&parts.headers) {
            return refuse(
                StatusCode::FORBIDDEN,
                &format!(
                    "refused: the form was sent from a page of another origin (Sec-Fetch-Site: {site}); use the dashboard's own pages"
                ),
            );
        }
        if planted.is_some() {
            return refuse(
                StatusCode::FORBIDDEN,
                &format!(
                    "refused: the browser sent {} {} cookies, and the dashboard sets one: another site on this host set the others. This answer deletes them; reload the dashboard's page and try again",
                    sent.len(),
                    names.csrf()
                ),
            );
        }
        let Ok(bytes) = to_bytes(body, FORM_LIMIT).await else {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "refused: the form is larger than 256 KiB",
            );
        };
        let presented = form_fields(&bytes)
            .into_iter()
            .find(|(k, _)| k == CSRF_FIELD)
            .map(|(_, v)| v);
        let ok = !new_cookie
            && presented
                .is_some_and(|t| verify(&d.secret, "csrf", &csrf_value(&csrf_cookie, &who), &t));
        if !ok {
            return refuse(
                StatusCode::FORBIDDEN,
                "refused: the form's CSRF token is missing or does not match this browser and sign-in; reload the page and try again",
            );
        }
        Body::from(bytes)
    } else {
        body
    };
    parts.extensions.insert(ctx);
    let mut response = next.run(Request::from_parts(parts, body)).await;
    set_cookies(&mut response);
    security_headers(response)
}

/// Headers on every response: no framing, no caching, no script or style but the dashboard's
/// own files, so that even markup that slipped past escaping could not run.
pub(crate) fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_verifies_only_for_its_cookie_and_secret() {
        let secret = random();
        let t = sign(&secret, "csrf", b"cookie-a");
        assert!(verify(&secret, "csrf", b"cookie-a", &t));
        assert!(!verify(&secret, "csrf", b"cookie-b", &t));
        assert!(!verify(&random(), "csrf", b"cookie-a", &t));
        assert!(!verify(&secret, "csrf", b"cookie-a", "zz"));
        assert!(!verify(&secret, "csrf", b"cookie-a", ""));
    }

    #[test]
    fn a_csrf_token_is_bound_to_who_is_signed_in() {
        let secret = random();
        let s = |n: &str| {
            Who::Session(Session {
                expires: 1,
                nonce: n.to_owned(),
            })
        };
        let t = csrf_token(&secret, "cookie", &s("a"));
        assert_eq!(t, csrf_token(&secret, "cookie", &s("a")));
        assert_ne!(t, csrf_token(&secret, "cookie", &s("b")));
        assert_ne!(t, csrf_token(&secret, "cookie", &Who::Nobody));
        assert_ne!(t, csrf_token(&secret, "other", &s("a")));
    }

    #[test]
    fn cookies_are_found_by_name_every_one() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; sqlx_broker_csrf=ab; b=2; sqlx_broker_csrf=cd"),
        );
        assert_eq!(cookies(&h, "sqlx_broker_csrf"), ["ab", "cd"]);
        assert!(cookies(&h, "c").is_empty());
    }

    #[test]
    fn loopback_names_are_told_from_others() {
        for n in [
            "localhost",
            "a.localhost",
            "127.0.0.1",
            "127.8.9.1",
            "::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_loopback_name(n), "{n}");
        }
        for n in [
            "attacker.example",
            "localhost.example",
            "10.0.0.1",
            "0.0.0.0",
            "::",
            "127.0.0.1.nip.io",
        ] {
            assert!(!is_loopback_name(n), "{n}");
        }
    }

    #[test]
    fn a_session_reads_back_only_as_made_and_until_it_expires() {
        let secret = random();
        let v = Session::start(&secret, "the-token-of-16-bytes", Duration::from_secs(60));
        let s = Session::read(&secret, "the-token-of-16-bytes", &v).unwrap();
        assert!(s.expires > unix_secs());
        assert_eq!(Session::read(&secret, "another-token-of-16", &v), None);
        assert_eq!(Session::read(&random(), "the-token-of-16-bytes", &v), None);
        let (_, rest) = v.split_once('.').unwrap();
        let later = format!("{}.{rest}", s.expires + 3600);
        assert_eq!(
            Session::read(&secret, "the-token-of-16-bytes", &later),
            None
        );
        let gone = Session::start(&secret, "the-token-of-16-bytes", Duration::ZERO);
        assert_eq!(Session::read(&secret, "the-token-of-16-bytes", &gone), None);
    }
}
