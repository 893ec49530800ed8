"""Config groups: resolvers, each shared group's checks, the key vocabularies, instantiation."""
