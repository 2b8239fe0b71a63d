//! Named `bool` flags for the tests: the coordinator's known-wrong rules ([`super::Variant`]) and
//! the simulation's faults, set by field name (`SIM_FAULTS`, and tests that name a rule).

/// A `Copy` struct of `bool` fields, all off by default, with `set(name, on)` and
/// `with(&[names])` by field name. A macro because a function cannot declare the fields.
macro_rules! flags {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $($(#[$field_meta:meta])* $field:ident,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        $vis struct $name {
            $($(#[$field_meta])* pub(crate) $field: bool,)*
        }

        impl $name {
            /// Turns the flag named `name` (its field name) on or off; `false` when there is
            /// no such flag.
            pub(crate) fn set(&mut self, name: &str, on: bool) -> bool {
                match name {
                    $(stringify!($field) => self.$field = on,)*
                    _ => return false,
                }
                true
            }

            /// The flags named in `names` on, the others off.
            ///
            /// # Panics
            /// On a name that is no flag: a misspelt test must not pass by testing nothing.
            pub(crate) fn with(names: &[&str]) -> Self {
                let mut flags = Self::default();
                for name in names {
                    assert!(flags.set(name, true), "no flag {name} in {}", stringify!($name));
                }
                flags
            }
        }
    };
}
