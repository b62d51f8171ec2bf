// Package kubenodes runs a real Kubernetes cluster on one machine for weft's
// tests (make e2e-kube): etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler in the underlay namespace, and nodes that are each a network
// namespace on the underlay plus a mount namespace of their own (per node
// /opt, /var/lib, /var/log, /run, and /etc as an overlay), running Debian's
// containerd and runc, a kubelet and kube-proxy (nftables mode) built from
// the pinned module e2e/kubeapi/tools. weft goes on as a user installs it:
// images imported into every containerd, then `kubectl apply -k` of
// e2e/kubenodes/overlay.
//
// The kubelet changes host-wide kernel settings (vm.overcommit_memory,
// kernel.panic, kernel.panic_on_oops, ...) and makes cgroups; the harness
// records the settings before and restores them, and removes its cgroups,
// on every exit path; a run killed before it could do so is cleaned up by
// the next one (a record in /run/weft-e2e-kubenodes). The root network
// namespace is never changed: every daemon runs inside the run's namespaces.
package kubenodes
