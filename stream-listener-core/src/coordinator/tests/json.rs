//! The JSON shape of the group metadata (docs/design.md §2).

use super::*;

#[test]
fn group_metadata_uses_the_field_names_of_the_design() {
    let mut f = Fixture::new(2);
    f.join("member-a");
    let json = serde_json::to_value(&f.group.meta).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for key in [
        "streamPrefix",
        "consumerGroup",
        "incarnation",
        "groupEpoch",
        "metadataVersion",
        "assignmentEpoch",
        "state",
        "shardCount",
        "readableShardSet",
        "updatedAt",
        "lastTransitionAt",
        "targetAssignment",
    ] {
        assert!(keys.contains(&key), "missing {key} in {keys:?}");
    }
    assert_eq!(json["state"], "RECONCILING");
    assert_eq!(
        json["targetAssignment"]["members"]["member-a"],
        serde_json::json!([0, 1])
    );
    assert_eq!(json["readableShardSet"], serde_json::json!([0, 1]));
    let member = serde_json::to_value(f.member("member-a")).unwrap();
    assert_eq!(member["state"], "ACTIVE");
    assert_eq!(member["assignedShards"], serde_json::json!([0, 1]));
    let back: GroupMetadata = serde_json::from_value(json).unwrap();
    assert_eq!(back, f.group.meta);
    let response =
        serde_json::to_value(f.member("member-a").last_response.clone().unwrap()).unwrap();
    assert_eq!(response["status"], "OK");
    assert_eq!(response["heartbeatIntervalMs"], 3000);
}
