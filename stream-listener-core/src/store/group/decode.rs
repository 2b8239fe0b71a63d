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

/// The `:leases` scores as expiries in µs. A score is a double: one later than
/// `now + MAX_TIMING` (no lease TTL is longer, so no real lease ends later; `+inf` included)
/// would keep a dead member's shards forever, and is refused; a negative one is an expired
/// lease (0): the member renews it or rejoins, so it is safe as it is.
pub(super) fn decode_leases(
    key: &str,
    leases: Vec<(String, f64)>,
    now: Micros,
) -> Result<HashMap<String, Micros>, StoreError> {
    let horizon = now.saturating_add(duration_us(MAX_TIMING));
    leases
        .into_iter()
        .map(|(member, score)| {
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
