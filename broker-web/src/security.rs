//! Who may see the dashboard and which requests may change state: the bearer token or the host
//! application's hook, the CSRF check of every POST, read-only mode, and the headers that keep
//! the pages from being framed, cached or made to run another origin's script.
//!
//! CSRF: the first response sets a random cookie (`HttpOnly`, `SameSite=Strict`); every form
//! carries `HMAC(secret, cookie)` in a hidden field, and a POST whose field does not match its
//! cookie is refused before any handler runs. The secret is made when the dashboard is built,
//! so a token cannot be forged without it, nor carried from one dashboard to another.

use std::sync::Arc;

use axum::body::{Body, to_bytes};
use axum::extract::{NestedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::pages;
use crate::{Inner, Operator};

/// The cookie that a form's CSRF token is bound to.
pub(crate) const CSRF_COOKIE: &str = "sqlx_broker_csrf";
/// The cookie that carries a bearer token signed in through the login form.
pub(crate) const AUTH_COOKIE: &str = "sqlx_broker_auth";
/// The form field of the CSRF token.
pub(crate) const CSRF_FIELD: &str = "csrf";
/// The largest form body read, in bytes (a page of ids is far below it).
const FORM_LIMIT: usize = 256 * 1024;

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

/// The value of cookie `name` in `headers`.
pub(crate) fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The fields of a form body, in order.
pub(crate) fn form_fields(body: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(body).into_owned().collect()
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

    let (mut parts, body) = req.into_parts();
    // Who is asking.
    let operator = match &d.auth {
        crate::Auth::Hook(hook) => match hook(&parts) {
            Some(Operator(name)) => name,
            None => {
                return security_headers(pages::refusal(
                    StatusCode::FORBIDDEN,
                    "not allowed: the host application's authorization refused this request",
                ));
            }
        },
        crate::Auth::Bearer(token) => {
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
            let cookie_ok = cookie(&parts.headers, AUTH_COOKIE)
                .is_some_and(|c| verify(&d.secret, "auth-cookie", token.as_bytes(), c));
            if !(header_ok || cookie_ok || public) {
                let login = format!("{base}/login");
                return security_headers(if parts.method == Method::GET {
                    Redirect::to(&login).into_response()
                } else {
                    let mut r = pages::refusal(
                        StatusCode::UNAUTHORIZED,
                        "not signed in: send Authorization: Bearer <token>, or sign in at the login page",
                    );
                    r.headers_mut()
                        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                    r
                });
            }
            "dashboard".to_owned()
        }
        crate::Auth::None => "dashboard".to_owned(),
    };

    // The CSRF cookie: this request's, or a new one that the response sets.
    let (csrf_cookie, new_cookie) = match cookie(&parts.headers, CSRF_COOKIE) {
        Some(c) if c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit()) => {
            (c.to_owned(), false)
        }
        _ => (hex(&random()), true),
    };
    let ctx = Ctx {
        base: base.clone(),
        csrf: sign(&d.secret, "csrf", csrf_cookie.as_bytes()),
        operator,
        read_only: d.read_only,
    };

    let body = if parts.method == Method::POST {
        if d.read_only && path != "/login" {
            return security_headers(pages::refusal(
                StatusCode::FORBIDDEN,
                "refused: the dashboard is read-only",
            ));
        }
        let bytes = match to_bytes(body, FORM_LIMIT).await {
            Ok(b) => b,
            Err(_) => {
                return security_headers(pages::refusal(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "refused: the form is larger than 256 KiB",
                ));
            }
        };
        let presented = form_fields(&bytes)
            .into_iter()
            .find(|(k, _)| k == CSRF_FIELD)
            .map(|(_, v)| v);
        let ok = !new_cookie
            && presented.is_some_and(|t| verify(&d.secret, "csrf", csrf_cookie.as_bytes(), &t));
        if !ok {
            return security_headers(pages::refusal(
                StatusCode::FORBIDDEN,
                "refused: the form's CSRF token is missing or does not match this browser; reload the page and try again",
            ));
        }
        Body::from(bytes)
    } else {
        body
    };
    parts.extensions.insert(ctx);
    let mut response = next.run(Request::from_parts(parts, body)).await;
    if new_cookie {
        let path = if base.is_empty() { "/" } else { base.as_str() };
        if let Ok(v) = HeaderValue::from_str(&format!(
            "{CSRF_COOKIE}={csrf_cookie}; Path={path}; HttpOnly; SameSite=Strict"
        )) {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }
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
    fn cookies_are_found_by_name() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; sqlx_broker_csrf=ab; b=2"),
        );
        assert_eq!(cookie(&h, CSRF_COOKIE), Some("ab"));
        assert_eq!(cookie(&h, "c"), None);
    }
}
