//! A component of another world (`test:other/other`): the host must refuse to load it.
wit_bindgen::generate!({ path: "wit", world: "other" });

struct Other;

impl Guest for Other {
    fn hello() -> String {
        "I am not a policy".into()
    }
}

export!(Other);
