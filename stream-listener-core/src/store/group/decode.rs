//! Decoding the loaded group hash and leases (docs/design.md §5.6): every value is checked, and a
//! corrupt one fails closed naming its key and field.

use std::collections::{BTreeMap, HashMap};

use super::decoded::DecodeCache;
use super::fast_path::apply_fast_path_state;
use super::{MEMBER, META, duration_us};
use crate::coordinator::{self, CoordinatorConfig, Group, MAX_TIMING};
use crate::model::{GroupMetadata, MemberMetadata, Micros};
use crate::store::StoreError;
use crate::store::stream::check_counter;

/// The group hash as text. A field name that is not UTF-8 is not one of docs/design.md §3.2, and a
/// `meta` or `member:<id>` value that is not UTF-8 is the group's state damaged: both fail closed,
/// naming the key (a conversion error would name neither). Every other value is derived or checked
/// by its own parser (the fast-path fields, the combining queue, the counters), so it is read with
/// U+FFFD in place of the bad bytes: it then fails that parser and is rewritten or named there.
pub(super) fn hash_text(
    key: &str,
    raw: Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<HashMap<String, String>, StoreError> {
    raw.into_iter()
        .map(|(name, value)| {
            let name = String::from_utf8(name).map_err(|e| {
                StoreError::malformed(
                    key,
                    format!(
                        "the group hash holds a field name that is not UTF-8 ({:?}), which no field stream-listener writes is; delete it (HDEL)",
                        String::from_utf8_lossy(e.as_bytes())
                    ),
                )
            })?;
            let value = if name == META || name.starts_with(MEMBER) {
                String::from_utf8(value).map_err(|_| {
                    StoreError::malformed(key, format!("field {name} is not UTF-8"))
                })?
            } else {
                String::from_utf8(value)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
            };
            Ok((name, value))
        })
        .collect()
}

/// The `:leases` scores as expiries in µs. A score is a double: one later than
/// `now + MAX_TIMING` (no lease TTL is longer, so no real lease ends later; `+inf` included)
/// would keep a dead member's shards forever, and is refused; a negative one is an expired
/// lease (0): the member renews it or rejoins, so it is safe as it is.
pub(super) fn decode_leases(
    key: &str,
    leases: Vec<(Vec<u8>, f64)>,
    now: Micros,
) -> Result<HashMap<String, Micros>, StoreError> {
    let horizon = now.saturating_add(duration_us(MAX_TIMING));
    leases
        .into_iter()
        .map(|(member, score)| {
            let member = String::from_utf8(member).map_err(|e| {
                let member = String::from_utf8_lossy(e.as_bytes()).into_owned();
                StoreError::malformed(
                    key,
                    format!(
                        "the lease of member {member:?} names a member id that is not UTF-8, which no member has; remove it (ZREM)"
                    ),
                )
            })?;
            // Also refuses NaN (no ordering), though Redis never stores one.
            if !matches!(
                score.partial_cmp(&(horizon as f64)),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            ) {
                return Err(StoreError::malformed(
                    key,
                    format!(
                        "the lease of member {member:?} ends at {score} µs, later than any lease TTL allows (now {now} µs + {} s); remove it (ZREM {key} {member:?}): the member renews its lease or joins again",
                        MAX_TIMING.as_secs()
                    ),
                ));
            }
            // Whole µs below 2^53 (now + a day): f64 holds them exactly; negative ones saturate to 0.
            Ok((member, score as Micros))
        })
        .collect()
}

/// Refuses counters of the group and member JSON at or above the limit (their `+ 1` must not
/// overflow, and a correction round must be able to go above them), and deadlines later than
/// `now + MAX_TIMING`: the coordinator sets each to now plus one timing (a lease TTL, the
/// rebalance timeout), so a later one is corrupt and would hold shards back, or keep a round
/// open, for as long as it says.
fn check_counters(
    key: &str,
    meta: &GroupMetadata,
    members: &BTreeMap<String, MemberMetadata>,
    now: Micros,
) -> Result<(), StoreError> {
    let horizon = now.saturating_add(duration_us(MAX_TIMING));
    let deadline = |field: &str, name: &str, value: Micros| {
        if value <= horizon {
            return Ok(());
        }
        Err(StoreError::malformed(
            key,
            format!(
                "{name} {value} in field {field} is later than any timing allows (now {now} µs + {} s)",
                MAX_TIMING.as_secs()
            ),
        ))
    };
    if let Some(at) = meta.hand_out_not_before {
        deadline(META, "handOutNotBefore", at)?;
    }
    if let Some(round) = &meta.correction_round {
        deadline(META, "correctionRound.notBeforeEnd", round.not_before_end)?;
    }
    check_counter(key, META, "incarnation", meta.incarnation)?;
    check_counter(key, META, "groupEpoch", meta.group_epoch.unsigned_abs())?;
    check_counter(
        key,
        META,
        "assignmentEpoch",
        meta.assignment_epoch.unsigned_abs(),
    )?;
    check_counter(key, META, "metadataVersion", meta.metadata_version)?;
    for (id, member) in members {
        let field = format!("{MEMBER}{id}");
        check_counter(
            key,
            &field,
            "memberEpoch",
            member.member_epoch.unsigned_abs(),
        )?;
        check_counter(key, &field, "lastRequestSeq", member.last_request_seq)?;
        deadline(
            &field,
            "memberLeaseExpiresAt",
            member.member_lease_expires_at,
        )?;
        if let Some(at) = member.revoke_deadline {
            deadline(&field, "revokeDeadline", at)?;
        }
        for holding in &member.old_process_holdings {
            deadline(
                &field,
                "oldProcessHoldings.leaseExpiresAt",
                holding.lease_expires_at,
            )?;
        }
    }
    Ok(())
}

pub(super) fn decode_group(
    key: &str,
    fields: &HashMap<String, String>,
    leases: &HashMap<String, Micros>,
    config: &CoordinatorConfig,
    now: Micros,
    cache: &Decoded,
) -> Result<Group, StoreError> {
    let json = fields
        .get(META)
        .ok_or_else(|| StoreError::malformed(key, "field meta is missing"))?;
    let meta = cache
        .meta
        .decode_all([(META, json.as_str())])
        .map_err(|(field, e)| StoreError::corrupt(key, field, e))?
        .pop()
        .map(|(_, meta)| meta)
        .ok_or_else(|| StoreError::malformed(key, "field meta is missing"))?;
    let member_fields = fields
        .iter()
        .filter(|(field, _)| field.starts_with(MEMBER))
        .map(|(field, json)| (field.as_str(), json.as_str()));
    let decoded = cache
        .members
        .decode_all(member_fields)
        .map_err(|(field, e)| StoreError::corrupt(key, field, e))?;
    let mut members = BTreeMap::new();
    for (field, mut member) in decoded {
        let id = &field[MEMBER.len()..];
        if let Some(lease) = leases.get(id) {
            // The fast path moves only the lease, by the member's own TTL (members of one group
            // may run different timings): the renewal it made is the lease minus that TTL.
            let ttl = coordinator::member_lease_ttl_us(&member, config);
            member.member_lease_expires_at = *lease;
            member.last_heartbeat_at = member.last_heartbeat_at.max(lease.saturating_sub(ttl));
        }
        apply_fast_path_state(key, fields, (id, &meta), &mut member)?;
        members.insert(id.to_owned(), member);
    }
    check_counters(key, &meta, &members, now)?;
    Ok(Group {
        meta,
        members,
        history: Default::default(),
    })
}

/// The decode caches of one store (and its clones): `meta` and the `member:<id>` JSON.
#[derive(Debug, Clone, Default)]
pub(super) struct Decoded {
    meta: DecodeCache<GroupMetadata>,
    members: DecodeCache<MemberMetadata>,
}
