"""Views of the cluster every part reads: the broker registry, namespaces, the load topics, and
the one place a broker is chosen for a bundle."""
