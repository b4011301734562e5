//! Response ids a cluster can trust: an id made by a member names it
//! (`iop_api::responses::id_stem`) and ends with a MAC of everything before it, keyed by
//! a secret the members share through etcd (`<prefix>/responses/key`, made once by the
//! first Edge that finds it absent, never written again). Another Edge checks the MAC
//! before it asks the named Edge for the conversation: a forged or altered id is refused
//! without a request. HMAC-SHA256 (ring: signed and verified there, in constant time).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ring::hmac;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::etcd::Etcd;
use crate::membership::ClusterView;

/// `stem` signed: `{stem}_{the MAC in hex}`.
pub(crate) fn sign(key: &hmac::Key, stem: &str) -> String {
    let tag = hmac::sign(key, stem.as_bytes());
    let mut id = String::with_capacity(stem.len() + 1 + 2 * tag.as_ref().len());
    id.push_str(stem);
    id.push('_');
    for b in tag.as_ref() {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

/// Whether response id `id` (`resp_{stem}_{mac}`) carries its stem's MAC.
pub(crate) fn verify(key: &hmac::Key, id: &str) -> bool {
    let Some((stem, given)) = id
        .strip_prefix("resp_")
        .and_then(|rest| rest.rsplit_once('_'))
    else {
        return false;
    };
    if given.len() % 2 != 0 || given.len() > 128 {
        return false;
    }
    let tag: Option<Vec<u8>> = (0..given.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(given.get(i..i + 2)?, 16).ok())
        .collect();
    tag.is_some_and(|tag| hmac::verify(key, stem.as_bytes(), &tag).is_ok())
}

/// Reads the cluster's response key from etcd, making it first when absent, and hands
/// it to `view`; tries again every second until it has it or `shutdown`.
pub(crate) async fn fetch_key(
    etcd: Arc<Etcd>,
    prefix: String,
    view: Arc<ClusterView>,
    shutdown: CancellationToken,
) {
    let key = format!("{prefix}/responses/key");
    loop {
        match etcd.get(&key).await {
            Ok((_, Some(kv))) => match B64.decode(&kv.value) {
                Ok(secret) if secret.len() >= 32 => {
                    view.set_responses_key(hmac::Key::new(hmac::HMAC_SHA256, &secret));
                    info!("cluster: response ids are signed with the cluster's key");
                    return;
                }
                _ => warn!(
                    key,
                    "cluster: the response key in etcd is unusable; response ids stay unsigned"
                ),
            },
            Ok((_, None)) => {
                let mut secret = [0u8; 32];
                if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
                    .is_ok()
                {
                    // Only if still absent: two Edges racing agree on the first one's.
                    let _ = etcd.put_if(&key, B64.encode(secret).as_bytes(), 0).await;
                    continue;
                }
            }
            Err(err) => warn!(error = %err, "cluster: cannot read the response key yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_id_verifies_and_any_change_does_not() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &[7; 32]);
        let other = hmac::Key::new(hmac::HMAC_SHA256, &[8; 32]);
        let id = format!("resp_{}", sign(&key, "656467652d61_00000000000000ab42"));
        assert!(verify(&key, &id));
        assert!(!verify(&other, &id), "another cluster's key");
        assert!(!verify(&key, &id.replace("_00", "_01")), "an altered stem");
        assert!(!verify(&key, &id[..id.len() - 1]), "a cut MAC");
        assert!(!verify(&key, "resp_656467652d61_00000000000000ab42"));
        assert!(!verify(&key, "msg_x_y"));
    }
}
