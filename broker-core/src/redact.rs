//! Database URLs without their passwords, for every message and log line that shows one: the
//! CLI's connect errors, the dashboard's pages, a backend's error that lists its hosts.
//!
//! A password can sit in two places of a URL: the user information (`postgres://alice:PW@db`)
//! and a query parameter (`?password=PW`, `&sslpassword=PW`). Both are replaced by `***`; the
//! user, host, port, database and the other parameters stay, since they are what an operator
//! needs to read the message.

/// `text` with the password of every URL in it replaced by `***`.
///
/// A URL is found by its `://` and runs to the next blank, so a URL inside a sentence, a
/// quoted TOML line or a JSON string is found, and a quote in a password does not end it.
/// Where the user information ends is read as a URL parser reads it (the last `@` before the
/// path), and where a malformed URL leaves that unclear (a `/` or `?` in an unencoded password)
/// more is hidden rather than less: the rule may hide a host of such a URL, or text after a URL
/// without a password up to an `@` (`postgres://db:5432/app","by":"a@b`), to never show a
/// password. A blank in a password (which a URL parser takes, encoded) ends the URL early: a
/// caller that knows the URL hides its password as a whole too.
///
/// ```
/// use broker_core::redact_passwords;
/// assert_eq!(
///     redact_passwords("cannot connect to postgres://alice:S3CRET@db:5432/app"),
///     "cannot connect to postgres://alice:***@db:5432/app"
/// );
/// assert_eq!(
///     redact_passwords("mysql://app@db/app?ssl-mode=required&password=S3CRET"),
///     "mysql://app@db/app?ssl-mode=required&password=***"
/// );
/// ```
pub fn redact_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail.find(char::is_whitespace).unwrap_or(tail.len());
        let (url, after) = tail.split_at(end);
        redact_one(url, &mut out);
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Writes `url` (what follows its `://`) to `out` without its passwords.
fn redact_one(url: &str, out: &mut String) {
    let mut rest = url;
    if let Some(first_at) = url.find('@') {
        // The user information ends at the last `@` before the path, query or fragment that
        // follows the first `@`: an `@` in a password (unencoded) belongs to it, one in the
        // query does not.
        let path = url[first_at..]
            .find(['/', '?', '#'])
            .map_or(url.len(), |i| first_at + i);
        let user_end = url[..path].rfind('@').unwrap_or(first_at);
        let user_info = &url[..user_end];
        match user_info.find(':') {
            Some(colon) if colon + 1 < user_end => {
                out.push_str(&user_info[..=colon]);
                out.push_str("***");
            }
            _ => out.push_str(user_info),
        }
        rest = &url[user_end..];
    }
    redact_query(rest, out);
}

/// Writes `rest` to `out` with the value of every password-like query parameter hidden.
fn redact_query(rest: &str, out: &mut String) {
    let mut chars = rest.char_indices().peekable();
    let mut written = 0;
    while let Some((i, c)) = chars.next() {
        if !matches!(c, '?' | '&' | ';') {
            continue;
        }
        let key_start = i + 1;
        let Some(eq) = rest[key_start..].find(['=', '&', '#']) else {
            break;
        };
        let key_end = key_start + eq;
        if rest[key_end..].starts_with('=') && secret_key(&rest[key_start..key_end]) {
            let value_start = key_end + 1;
            let value_end = rest[value_start..]
                .find(['&', '#', ';'])
                .map_or(rest.len(), |j| value_start + j);
            out.push_str(&rest[written..value_start]);
            if value_end > value_start {
                out.push_str("***");
            }
            written = value_end;
            while chars.peek().is_some_and(|&(j, _)| j < value_end) {
                chars.next();
            }
        }
    }
    out.push_str(&rest[written..]);
}

/// Whether a query parameter named `key` carries a password (`password`, `sslpassword`,
/// `pass`, `pwd`, in any case).
fn secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.ends_with("password") || matches!(key.as_str(), "pass" | "passwd" | "pwd")
}

#[cfg(test)]
mod tests {
    use super::redact_passwords as r;

    #[test]
    fn the_password_in_a_url_is_hidden_and_the_rest_stays() {
        assert_eq!(
            r("postgres://alice:S3CRETPW@db.example:5432/app?application_name=w"),
            "postgres://alice:***@db.example:5432/app?application_name=w"
        );
        assert_eq!(
            r("mysql://root:S3CRETPW@127.0.0.1:3306/test"),
            "mysql://root:***@127.0.0.1:3306/test"
        );
        assert_eq!(
            r("postgres://alice:p%40ss@db/app"),
            "postgres://alice:***@db/app"
        );
    }

    #[test]
    fn urls_without_a_password_are_left_as_they_are() {
        for s in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgres://db/app",
            "sqlite://./jobs.db",
            "sqlite:jobs.db",
            "postgres://alice:@db/app",
            "no url here: a:b@c",
            "postgres://db/app?application_name=a@b",
        ] {
            assert_eq!(r(s), s);
        }
    }

    #[test]
    fn a_malformed_password_is_hidden_whole() {
        assert_eq!(
            r("postgres://alice:p@ss@db/app"),
            "postgres://alice:***@db/app"
        );
        assert_eq!(
            r("postgres://alice:pa/ss@db/app"),
            "postgres://alice:***@db/app"
        );
        assert_eq!(
            r("postgres://alice:pa?ss@db/app"),
            "postgres://alice:***@db/app"
        );
        assert_eq!(
            r("postgres://alice:pa#ss@db/app"),
            "postgres://alice:***@db/app"
        );
        assert_eq!(
            r("postgres://alice:S3\"CR'ET@db/app"),
            "postgres://alice:***@db/app"
        );
        assert_eq!(
            r("url = \"postgres://alice:S3\"CR@db/app\""),
            "url = \"postgres://alice:***@db/app\""
        );
    }

    #[test]
    fn a_password_in_the_query_is_hidden() {
        assert_eq!(
            r("postgres://db/app?password=S3CRET&sslmode=require"),
            "postgres://db/app?password=***&sslmode=require"
        );
        assert_eq!(
            r("postgres://db/app?sslmode=verify-full&SSLPASSWORD=S3CRET"),
            "postgres://db/app?sslmode=verify-full&SSLPASSWORD=***"
        );
        assert_eq!(
            r("postgres://u:a@db/app?pwd=b&user=c"),
            "postgres://u:***@db/app?pwd=***&user=c"
        );
    }

    #[test]
    fn every_url_in_a_sentence_is_found() {
        assert_eq!(
            r("none of the 2 hosts takes writes: postgres://a:X1@h1/db, postgres://a:X2@h2/db"),
            "none of the 2 hosts takes writes: postgres://a:***@h1/db, postgres://a:***@h2/db"
        );
        // A quoted TOML line and a JSON string.
        assert_eq!(
            r("1 | url = \"postgres://a:X1@h/db\nx\""),
            "1 | url = \"postgres://a:***@h/db\nx\""
        );
        assert_eq!(
            r("{\"error\":\"cannot connect to mysql://a:X1@h/db: refused\"}"),
            "{\"error\":\"cannot connect to mysql://a:***@h/db: refused\"}"
        );
    }
}
