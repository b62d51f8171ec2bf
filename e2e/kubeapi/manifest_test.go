package kubeapi

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

// The ServiceAccount's permissions, one tuple per (resource, verb, name);
// exactly these, no more: the router's Kubernetes code uses all of them.
var (
	wantClusterPerms = []perm{
		{"", "nodes", "get", ""},
		{"", "nodes", "list", ""},
		{"", "nodes", "watch", ""},
		{"", "nodes/status", "patch", ""},
		// NetworkPolicy: the informers and an ADD's read of its pod.
		{"", "pods", "get", ""},
		{"", "pods", "list", ""},
		{"", "pods", "watch", ""},
		{"", "namespaces", "get", ""},
		{"", "namespaces", "list", ""},
		{"", "namespaces", "watch", ""},
		{"networking.k8s.io", "networkpolicies", "get", ""},
		{"networking.k8s.io", "networkpolicies", "list", ""},
		{"networking.k8s.io", "networkpolicies", "watch", ""},
	}
	wantNamespacePerms = []perm{
		{"", "configmaps", "create", ""},
		{"", "configmaps", "get", "weft"},
		{"", "configmaps", "update", "weft"},
		{"apps", "daemonsets", "get", "weft"},
		{"apps", "daemonsets", "list", "weft"},
		{"apps", "daemonsets", "watch", "weft"},
	}
	// hostPaths the router container mounts at the same path (the router's
	// default --cni-bin-dir, --cni-conf-dir, --state-dir, --socket dir, ...).
	wantHostPaths = map[string]corev1.HostPathType{
		"/opt/cni/bin":      corev1.HostPathDirectoryOrCreate,
		"/etc/cni/net.d":    corev1.HostPathDirectoryOrCreate,
		"/var/lib/weft":     corev1.HostPathDirectoryOrCreate,
		"/run/weft":         corev1.HostPathDirectoryOrCreate,
		"/run/xtables.lock": corev1.HostPathFileOrCreate,
	}
)

func init() {
	sortPerms(wantClusterPerms)
	sortPerms(wantNamespacePerms)
}

// perm is one permission an RBAC rule grants.
type perm struct{ Group, Resource, Verb, Name string }

func (p perm) String() string {
	s := p.Verb + " " + p.Resource
	if p.Group != "" {
		s += "." + p.Group
	}
	if p.Name != "" {
		s += "/" + p.Name
	}
	return s
}

// perms expands rules into sorted tuples; a rule with anything the tuples
// cannot express (non-resource URLs) yields a "*" tuple that never matches.
func perms(rules []rbacv1.PolicyRule) []perm {
	var out []perm
	for _, r := range rules {
		if len(r.NonResourceURLs) > 0 {
			out = append(out, perm{"*", "nonResourceURLs", "*", strings.Join(r.NonResourceURLs, ",")})
		}
		names := r.ResourceNames
		if len(names) == 0 {
			names = []string{""}
		}
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					for _, n := range names {
						out = append(out, perm{g, res, v, n})
					}
				}
			}
		}
	}
	sortPerms(out)
	return slices.Compact(out)
}

func sortPerms(ps []perm) {
	slices.SortFunc(ps, func(a, b perm) int { return strings.Compare(a.String(), b.String()) })
}

// decodeManifest decodes every document of a multi-document YAML strictly
// (unknown or duplicate fields are errors) into client-go's typed objects.
func decodeManifest(data []byte) ([]runtime.Object, error) {
	dec := serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []runtime.Object
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i, err)
		}
		objs = append(objs, obj)
	}
}

// stripComments drops comment-only lines, to tell an empty document.
func stripComments(doc []byte) []byte {
	var b bytes.Buffer
	for _, l := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' && !bytes.Equal(t, []byte("---")) {
			b.Write(l)
			b.WriteByte('\n')
		}
	}
	return b.Bytes()
}

// checkManifest checks that the objects are exactly weft's: RBAC with the
// permissions above and bound to the ServiceAccount, and a DaemonSet with
// every property docs/kubernetes.md promises. It returns every problem.
func checkManifest(data []byte) error {
	objs, err := decodeManifest(data)
	if err != nil {
		return err
	}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	var (
		sa  *corev1.ServiceAccount
		cr  *rbacv1.ClusterRole
		crb *rbacv1.ClusterRoleBinding
		ro  *rbacv1.Role
		rb  *rbacv1.RoleBinding
		ds  *appsv1.DaemonSet
	)
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.ServiceAccount:
			sa = o
		case *rbacv1.ClusterRole:
			cr = o
		case *rbacv1.ClusterRoleBinding:
			crb = o
		case *rbacv1.Role:
			ro = o
		case *rbacv1.RoleBinding:
			rb = o
		case *appsv1.DaemonSet:
			ds = o
		default:
			bad("unexpected object %T", o)
		}
	}
	if len(objs) != 6 {
		bad("%d objects, want 6 (ServiceAccount, ClusterRole, ClusterRoleBinding, Role, RoleBinding, DaemonSet)", len(objs))
	}
	if sa == nil || cr == nil || crb == nil || ro == nil || rb == nil || ds == nil {
		bad("missing objects: ServiceAccount %v ClusterRole %v ClusterRoleBinding %v Role %v RoleBinding %v DaemonSet %v",
			sa != nil, cr != nil, crb != nil, ro != nil, rb != nil, ds != nil)
		return errors.Join(errs...)
	}
	for _, m := range []struct {
		kind, name, ns string
	}{
		{"ServiceAccount", sa.Name, sa.Namespace}, {"Role", ro.Name, ro.Namespace},
		{"RoleBinding", rb.Name, rb.Namespace}, {"DaemonSet", ds.Name, ds.Namespace},
	} {
		if m.name != "weft" || m.ns != "kube-system" {
			bad("%s is %s/%s, want kube-system/weft", m.kind, m.ns, m.name)
		}
	}
	if cr.Name != "weft" || crb.Name != "weft" {
		bad("ClusterRole %q and ClusterRoleBinding %q must be named weft", cr.Name, crb.Name)
	}
	if got := perms(cr.Rules); !slices.Equal(got, wantClusterPerms) || cr.AggregationRule != nil {
		bad("ClusterRole grants %v, want exactly %v", got, wantClusterPerms)
	}
	if got := perms(ro.Rules); !slices.Equal(got, wantNamespacePerms) {
		bad("Role grants %v, want exactly %v", got, wantNamespacePerms)
	}
	wantSubject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: "weft", Namespace: "kube-system"}}
	if crb.RoleRef != (rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "weft"}) || !slices.Equal(crb.Subjects, wantSubject) {
		bad("ClusterRoleBinding binds %v to %v, want ClusterRole weft to %v", crb.RoleRef, crb.Subjects, wantSubject)
	}
	if rb.RoleRef != (rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "weft"}) || !slices.Equal(rb.Subjects, wantSubject) {
		bad("RoleBinding binds %v to %v, want Role weft to %v", rb.RoleRef, rb.Subjects, wantSubject)
	}
	errs = append(errs, checkDaemonSet(ds)...)
	return errors.Join(errs...)
}

// checkDaemonSet checks the DaemonSet's scheduling, security, probes,
// environment and volumes.
func checkDaemonSet(ds *appsv1.DaemonSet) []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("DaemonSet: "+format, args...)) }
	spec := ds.Spec.Template.Spec

	if ds.Spec.Selector == nil || len(ds.Spec.Selector.MatchLabels) == 0 {
		bad("no selector")
	} else {
		for k, v := range ds.Spec.Selector.MatchLabels {
			if ds.Spec.Template.Labels[k] != v {
				bad("selector %s=%s does not match the pod labels %v", k, v, ds.Spec.Template.Labels)
			}
		}
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil || us.RollingUpdate.MaxUnavailable == nil ||
		*us.RollingUpdate.MaxUnavailable != intstr.FromInt32(1) {
		bad("updateStrategy %+v, want RollingUpdate with maxUnavailable 1", us)
	}
	if spec.ServiceAccountName != "weft" {
		bad("serviceAccountName %q, want weft", spec.ServiceAccountName)
	}
	if spec.AutomountServiceAccountToken != nil && !*spec.AutomountServiceAccountToken {
		bad("automountServiceAccountToken is false: the router needs its token")
	}
	if !spec.HostNetwork {
		bad("hostNetwork is not true: the router configures the node's network")
	}
	if spec.HostPID || spec.HostIPC {
		bad("hostPID/hostIPC set: weft needs neither")
	}
	if spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		bad("dnsPolicy %q, want ClusterFirstWithHostNet", spec.DNSPolicy)
	}
	if spec.PriorityClassName != "system-node-critical" {
		bad("priorityClassName %q, want system-node-critical", spec.PriorityClassName)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(t corev1.Toleration) bool {
		return t.Operator == corev1.TolerationOpExists && t.Key == "" && t.Effect == "" && t.TolerationSeconds == nil
	}) {
		bad("tolerations %v: want `operator: Exists` alone (every taint, also NotReady and Unreachable)", spec.Tolerations)
	}
	if spec.TerminationGracePeriodSeconds == nil || *spec.TerminationGracePeriodSeconds < 5 {
		bad("terminationGracePeriodSeconds not set (or under 5 s): the router saves its state on SIGTERM")
	}

	vols := map[string]*corev1.HostPathVolumeSource{}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			vols[v.Name] = v.HostPath
		}
	}
	hostPathOf := func(m corev1.VolumeMount) string {
		if hp := vols[m.Name]; hp != nil {
			return hp.Path
		}
		return ""
	}

	if len(spec.InitContainers) != 1 {
		bad("%d init containers, want 1 (install-cni)", len(spec.InitContainers))
	}
	if len(spec.Containers) != 1 {
		bad("%d containers, want 1 (weft)", len(spec.Containers))
		return errs
	}
	c := spec.Containers[0]
	for _, ic := range spec.InitContainers {
		if ic.Image != c.Image {
			bad("init container image %q differs from the router's %q", ic.Image, c.Image)
		}
		if len(ic.Command) != 3 || ic.Command[0] != "/usr/bin/weft" || ic.Command[1] != "install-cni" {
			bad("init container command %q, want [/usr/bin/weft install-cni DIR]", ic.Command)
			continue
		}
		if !slices.ContainsFunc(ic.VolumeMounts, func(m corev1.VolumeMount) bool {
			return m.MountPath == ic.Command[2] && hostPathOf(m) == "/opt/cni/bin" && !m.ReadOnly
		}) {
			bad("init container installs into %s, which is not the host's /opt/cni/bin mounted read-write", ic.Command[2])
		}
		if sc := ic.SecurityContext; sc != nil && sc.Privileged != nil && *sc.Privileged {
			bad("init container is privileged: copying files needs no privilege")
		}
	}

	if !slices.Equal(c.Command, []string{"/usr/bin/weft"}) || len(c.Args) == 0 || c.Args[0] != "router" || !slices.Contains(c.Args, "--kube") {
		bad("container runs %q %q, want /usr/bin/weft router --kube ...", c.Command, c.Args)
	}
	if !slices.Contains(c.Args, "--network-policy=true") {
		bad("container args %q: want --network-policy=true (NetworkPolicy enforced, and said so in the manifest)", c.Args)
	}
	if c.ImagePullPolicy == corev1.PullAlways {
		bad("imagePullPolicy Always: nodes with an imported image and no registry could not start weft")
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	for name, path := range map[string]string{"NODE_NAME": "spec.nodeName", "POD_NAMESPACE": "metadata.namespace"} {
		if e := env[name]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != path {
			bad("env %s must come from the downward API field %s", name, path)
		}
	}
	if r, ok := env["WEFT_IPALLOC_RANGE"]; !ok {
		bad("env WEFT_IPALLOC_RANGE missing")
	} else if p, err := netip.ParsePrefix(r.Value); err != nil || !p.Addr().Is4() || p.Masked() != p {
		bad("env WEFT_IPALLOC_RANGE %q is not an IPv4 CIDR with its host bits zero", r.Value)
	}
	if e := env["WEFT_PASSWORD"]; e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil ||
		e.ValueFrom.SecretKeyRef.Name != "weft-passwd" || e.ValueFrom.SecretKeyRef.Key != "password" ||
		e.ValueFrom.SecretKeyRef.Optional == nil || !*e.ValueFrom.SecretKeyRef.Optional {
		bad("env WEFT_PASSWORD must come from the optional Secret weft-passwd, key password")
	}

	// Privileged for the sysctls only (the comment in weft.yaml says why);
	// a change there must come with the code that makes it possible.
	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil || !*sc.Privileged {
		bad("the router is not privileged: it writes its bridge's sysctls, and /proc/sys is read-only in an unprivileged container")
	}
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		bad("the router's root filesystem is writable: it writes only to its hostPath volumes")
	}

	for _, p := range []struct {
		what  string
		probe *corev1.Probe
		path  string
	}{{"livenessProbe", c.LivenessProbe, "/healthz"}, {"readinessProbe", c.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			bad("%s missing or not httpGet", p.what)
			continue
		}
		g := p.probe.HTTPGet
		if g.Host != "127.0.0.1" || g.Port != intstr.FromInt32(6784) || g.Path != p.path {
			bad("%s is %s:%s%s, want 127.0.0.1:6784%s (the status server is on loopback; with hostNetwork a probe without host goes to the node's IP)",
				p.what, g.Host, g.Port.String(), g.Path, p.path)
		}
	}

	req := c.Resources.Requests
	if req.Cpu().IsZero() || req.Memory().IsZero() {
		bad("resource requests %v: want cpu and memory", req)
	}
	if lim, ok := c.Resources.Limits[corev1.ResourceMemory]; ok && lim.Cmp(resource.MustParse("256Mi")) < 0 {
		bad("memory limit %s is too low for the router under churn", lim.String())
	}
	if _, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
		bad("CPU limit set: throttling the router delays every cross-node packet")
	}

	mounted := map[string]string{} // host path -> mount path
	for _, m := range c.VolumeMounts {
		if hp := hostPathOf(m); hp != "" {
			mounted[hp] = m.MountPath
			if m.ReadOnly {
				bad("volume %s (%s) is mounted read-only; the router writes there", m.Name, hp)
			}
		}
	}
	for hp, typ := range wantHostPaths {
		if mounted[hp] != hp {
			bad("the router container does not mount the host's %s at %s", hp, hp)
		}
		for _, v := range vols {
			if v.Path == hp && (v.Type == nil || *v.Type != typ) {
				bad("hostPath %s has type %v, want %s", hp, v.Type, typ)
			}
		}
	}
	return errs
}

func readDeploy(t *testing.T, name string) []byte {
	t.Helper()
	dir, err := DeployDir()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestManifest decodes deploy/weft.yaml strictly and checks every object.
func TestManifest(t *testing.T) {
	if err := checkManifest(readDeploy(t, "weft.yaml")); err != nil {
		t.Fatalf("deploy/weft.yaml:\n%v", err)
	}
}

// TestManifestCatchesBrokenEdits makes edits that would break a cluster or
// widen the ServiceAccount's rights, and checks that each one fails.
func TestManifestCatchesBrokenEdits(t *testing.T) {
	orig := string(readDeploy(t, "weft.yaml"))
	edits := []struct{ name, old, new string }{
		{"extra cluster verb", `verbs: ["get", "list", "watch"]`, `verbs: ["get", "list", "watch", "delete"]`},
		{"nodes patch instead of nodes/status", `resources: ["nodes/status"]`, `resources: ["nodes"]`},
		{"configmaps of any name", `    resourceNames: ["weft"]` + "\n", ""},
		{"secrets readable", `resources: ["configmaps"]
    verbs: ["create"]`, `resources: ["configmaps", "secrets"]
    verbs: ["create", "get"]`},
		{"binding to another account", "    name: weft\n    namespace: kube-system\n---\napiVersion: apps/v1\n", "    name: default\n    namespace: kube-system\n---\napiVersion: apps/v1\n"},
		{"no hostNetwork", "hostNetwork: true", "hostNetwork: false"},
		{"wrong dnsPolicy", "dnsPolicy: ClusterFirstWithHostNet", "dnsPolicy: ClusterFirst"},
		{"no priority class", "      priorityClassName: system-node-critical\n", ""},
		{"tolerations narrowed", "        - operator: Exists\n", "        - operator: Exists\n          effect: NoSchedule\n"},
		{"not privileged", "            privileged: true\n", "            privileged: false\n"},
		{"writable root", "            privileged: true\n            readOnlyRootFilesystem: true\n", "            privileged: true\n"},
		{"hostPID", "hostNetwork: true", "hostNetwork: true\n      hostPID: true"},
		{"probe on node IP", "              host: 127.0.0.1\n              path: /healthz\n", "              path: /healthz\n"},
		{"readiness path", "path: /readyz", "path: /healthz"},
		{"no --kube", `args: ["router", "--kube", "--network-policy=true"]`, `args: ["router", "--network-policy=true"]`},
		{"no --network-policy", `"--kube", "--network-policy=true"]`, `"--kube"]`},
		{"pods writable", `resources: ["pods", "namespaces"]
    verbs: ["get", "list", "watch"]`, `resources: ["pods", "namespaces"]
    verbs: ["get", "list", "watch", "update"]`},
		{"no networkpolicies", `resources: ["networkpolicies"]`, `resources: ["ingresses"]`},
		{"maxUnavailable 3", "maxUnavailable: 1", "maxUnavailable: 3"},
		{"xtables lock gone", "            - name: xtables-lock\n              mountPath: /run/xtables.lock\n", ""},
		{"state not on the host", "            path: /var/lib/weft\n", "            path: /tmp/weft\n"},
		{"init container into the image", `"install-cni", "/host/opt/cni/bin"`, `"install-cni", "/opt/cni/bin"`},
		{"NODE_NAME not from the downward API", "                  fieldPath: spec.nodeName\n            - name: POD_NAMESPACE", "                  fieldPath: metadata.name\n            - name: POD_NAMESPACE"},
		{"password required", "optional: true", "optional: false"},
		{"bad range", `value: "10.32.0.0/12"`, `value: "10.32.0.1/12"`},
		{"unknown field", "hostNetwork: true", "hostNetwork: true\n      hostNetwrok: true"},
		{"CPU limit", "            limits:\n", "            limits:\n              cpu: 100m\n"},
	}
	for _, e := range edits {
		t.Run(e.name, func(t *testing.T) {
			if !strings.Contains(orig, e.old) {
				t.Fatalf("deploy/weft.yaml no longer contains %q: update this edit", e.old)
			}
			broken := strings.Replace(orig, e.old, e.new, 1)
			err := checkManifest([]byte(broken))
			if err == nil {
				t.Fatalf("the edit %q -> %q passed the checks", e.old, e.new)
			}
			t.Logf("caught: %v", err)
		})
	}
}

// TestPerms: the rule expansion the checks rely on.
func TestPerms(t *testing.T) {
	got := perms([]rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"a", "b"}, Verbs: []string{"get"}, ResourceNames: []string{"x"}},
		{APIGroups: []string{"apps"}, Resources: []string{"a"}, Verbs: []string{"list", "get"}},
		{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}},
	})
	want := []perm{{"apps", "a", "get", ""}, {"", "a", "get", "x"}, {"", "b", "get", "x"}, {"apps", "a", "list", ""}, {"*", "nonResourceURLs", "*", "/metrics"}}
	sortPerms(want)
	if !slices.Equal(got, want) {
		t.Errorf("perms = %v, want %v", got, want)
	}
}
