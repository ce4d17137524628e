//! Where a server of the run listens, and the guard it wants there: the binary's control
//! endpoint and the row stream (the binary's and the bridge's) check their address and
//! token by these rules before anything runs.

use std::net::{IpAddr, SocketAddr};

/// An address to listen on: `PORT` (on 127.0.0.1) or `HOST:PORT`, `HOST` an IP address.
/// `set_token` says, in a refusal, how to set the token an exposed address wants.
pub fn listen_address(text: &str, set_token: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse().map_err(|_| {
        format!(
            "'{text}' is not an address to listen on: expected PORT (on 127.0.0.1) or HOST:PORT \
             with HOST an IP address, such as 9090 or 127.0.0.1:9090 (an address other machines \
             reach, such as 0.0.0.0:9090, also wants a token: {set_token})"
        )
    })
}

/// Refuses a token that guards nothing: an empty one, or one an `Authorization` header
/// cannot carry. `what` names it in the message (`the row stream's token
/// (serve_rows_token)`).
pub fn check_token(token: &str, what: &str) -> Result<(), String> {
    if token.is_empty() {
        return Err(format!(
            "{what} is empty, and an empty token guards nothing: set one that is hard to guess \
             (e.g. `openssl rand -hex 32`), or none to listen on a loopback address without one"
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{what} holds a space, a control or a non-ASCII character, which an Authorization \
             header cannot carry: use letters, digits and punctuation"
        ));
    }
    Ok(())
}

/// Refuses an address other machines reach (anything but 127.0.0.0/8 and ::1) when no token
/// is set: anyone reaching it could read what it serves or steer the run. `how` says how to
/// set one (`--listen-token TOKEN or ASYNC_GRPO_LISTEN_TOKEN`).
pub fn check_reach(address: SocketAddr, token_set: bool, how: &str) -> Result<(), String> {
    if token_set || is_loopback(address.ip()) {
        return Ok(());
    }
    Err(format!(
        "{address} is reachable from other machines, and without a token anyone who reaches it \
         can steer the run: set a token with {how}, or listen on a loopback address (a bare \
         port listens on 127.0.0.1)"
    ))
}

/// 127.0.0.0/8 and ::1, also written as an IPv4-mapped IPv6 address.
pub fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_listens_on_loopback_and_anything_else_must_be_an_address() {
        assert_eq!(
            listen_address("9090", "T"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 9090)))
        );
        assert_eq!(
            listen_address("0.0.0.0:1", "T"),
            Ok(SocketAddr::from(([0, 0, 0, 0], 1)))
        );
        for bad in ["localhost:9090", "", "99999", "1.2.3.4"] {
            let refused = listen_address(bad, "--the-flag").expect_err(bad);
            assert!(refused.contains("wants a token: --the-flag"), "{refused}");
        }
    }

    #[test]
    fn an_exposed_address_wants_a_token_that_guards_something() {
        let on = |ip: &str| SocketAddr::new(ip.parse().expect("an IP address"), 9090);
        for loopback in ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(check_reach(on(loopback), false, "T"), Ok(()), "{loopback}");
        }
        for exposed in ["0.0.0.0", "10.0.0.2", "::", "::ffff:10.0.0.2"] {
            let refused = check_reach(on(exposed), false, "--the-flag").expect_err(exposed);
            assert!(refused.contains("--the-flag"), "{refused}");
            assert_eq!(check_reach(on(exposed), true, "T"), Ok(()), "{exposed}");
        }
        assert!(check_token("", "the token").is_err_and(|e| e.starts_with("the token is empty")));
        for unusable in ["a b", "tab\t", "é", "new\nline"] {
            assert!(check_token(unusable, "T").is_err(), "{unusable:?}");
        }
        assert_eq!(check_token("s3cret-TOKEN_~!", "T"), Ok(()));
    }
}
