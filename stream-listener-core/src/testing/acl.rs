//! The `ACL SETUSER` rules README.md documents ("ACL users"), read from the README itself so
//! the tests create exactly the users the README tells operators to create: the README cannot
//! drift from what is tested.

/// One `ACL SETUSER` rule of the README: the user, its password and the rule's arguments.
#[derive(Clone, PartialEq, Eq)]
pub struct AclRule {
    /// The user name (`sl-listener`, `sl-producer`, `sl-admin`).
    pub user: String,
    /// The password of its `>password` token.
    pub password: String,
    /// Every argument after `ACL SETUSER <user>`, in order (`on`, `>…`, `resetkeys`, `~…`, `+…`).
    pub rules: Vec<String>,
    /// The arguments of a later `ACL SETUSER <user>` line of the section: what a Redis Cluster
    /// needs on top (`+cluster|slots`, `+asking`); empty when there is none.
    pub cluster_rules: Vec<String>,
}

// The password is a test value, but a Debug that prints it would be the habit this crate avoids.
impl std::fmt::Debug for AclRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AclRule")
            .field("user", &self.user)
            .field(
                "rules",
                &self
                    .rules
                    .iter()
                    .filter(|r| !r.starts_with('>'))
                    .collect::<Vec<_>>(),
            )
            .field("cluster_rules", &self.cluster_rules)
            .finish()
    }
}

impl AclRule {
    /// This rule without the argument `rule` (e.g. `+xclaim` or `~sl:{orders:billing}:group`),
    /// for testing what a missing permission does. `None` if the rule has no such argument.
    pub fn without(&self, rule: &str) -> Option<AclRule> {
        let position = self.rules.iter().position(|r| r == rule)?;
        let mut rules = self.rules.clone();
        rules.remove(position);
        Some(AclRule {
            rules,
            ..self.clone()
        })
    }

    /// The `+command` arguments (command permissions).
    pub fn commands(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .filter(|r| r.starts_with('+'))
            .map(String::as_str)
    }

    /// The `~pattern` and `%R~`/`%W~` arguments (key permissions).
    pub fn key_patterns(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .filter(|r| r.starts_with('~') || r.starts_with('%'))
            .map(String::as_str)
    }

    /// `redis://<user>:<password>@<addr>` for a server at `addr` (`host:port`).
    pub fn url(&self, addr: &str) -> String {
        format!("redis://{}:{}@{addr}", self.user, self.password)
    }

    /// Creates the user on the server (`ACL SETUSER`), after removing any earlier one of the
    /// same name (`ACL DELUSER`), so the user has exactly this rule.
    ///
    /// # Errors
    /// The server's error, e.g. an unknown command in the rule.
    pub fn apply(&self, conn: &mut impl redis::ConnectionLike) -> redis::RedisResult<()> {
        redis::cmd("ACL")
            .arg("DELUSER")
            .arg(&self.user)
            .exec(conn)?;
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&self.user)
            .arg(&self.rules)
            .exec(conn)
    }

    /// [`AclRule::apply`], then the [`AclRule::cluster_rules`] (for every node of a cluster).
    ///
    /// # Errors
    /// As [`AclRule::apply`].
    pub fn apply_for_cluster(
        &self,
        conn: &mut impl redis::ConnectionLike,
    ) -> redis::RedisResult<()> {
        self.apply(conn)?;
        if self.cluster_rules.is_empty() {
            return Ok(());
        }
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&self.user)
            .arg(&self.cluster_rules)
            .exec(conn)
    }
}

/// The rules of README.md's `### ACL users` section: every line that starts with
/// `ACL SETUSER`, split on whitespace, in order; a user's first line is its rule, a later line
/// its [`AclRule::cluster_rules`].
///
/// # Errors
/// A message when the section is missing, a rule has no user or no `>password`.
pub fn readme_acl_rules(readme: &str) -> Result<Vec<AclRule>, String> {
    let start = readme
        .find("\n### ACL users\n")
        .ok_or("README.md has no `### ACL users` section")?;
    let section = &readme[start + 1..];
    let end = section[4..].find("\n#").map_or(section.len(), |i| i + 4);
    let mut rules = Vec::new();
    for line in section[..end].lines() {
        let Some(rest) = line.trim().strip_prefix("ACL SETUSER ") else {
            continue;
        };
        let mut words = rest.split_whitespace().map(str::to_owned);
        let user = words.next().ok_or_else(|| format!("no user in {line:?}"))?;
        let rule: Vec<String> = words.collect();
        if let Some(first) = rules.iter_mut().find(|r: &&mut AclRule| r.user == user) {
            first.cluster_rules.extend(rule);
            continue;
        }
        let password = rule
            .iter()
            .find_map(|r| r.strip_prefix('>'))
            .ok_or_else(|| format!("no >password in the rule of {user}"))?
            .to_owned();
        rules.push(AclRule {
            user,
            password,
            rules: rule,
            cluster_rules: Vec::new(),
        });
    }
    if rules.is_empty() {
        return Err("README.md's `### ACL users` section has no `ACL SETUSER` line".into());
    }
    Ok(rules)
}

/// The rule of `user` among `rules`.
///
/// # Errors
/// A message naming the user when the README has no rule for it.
pub fn rule_of<'a>(rules: &'a [AclRule], user: &str) -> Result<&'a AclRule, String> {
    rules
        .iter()
        .find(|r| r.user == user)
        .ok_or_else(|| format!("README.md has no ACL SETUSER rule for {user}"))
}
