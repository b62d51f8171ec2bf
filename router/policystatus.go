package router

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/weft-net/weft/policy"
)

// PolicyReport is the NetworkPolicy part of /report and the content of
// /status/policy: what is in force on this node.
type PolicyReport struct {
	Enabled bool   `json:"enabled"`
	Off     string `json:"off,omitempty"` // why it is off
	Node    string `json:"node,omitempty"`
	// Synced: the pod, namespace and NetworkPolicy lists have been read.
	Synced bool `json:"synced"`
	// Error is why the lists cannot be read, or why the last Sync failed.
	Error string `json:"error,omitempty"`
	// Applied: the policies below are the rules in force (the last sync
	// succeeded); if not, they are what failed to apply.
	Applied   bool   `json:"applied"`
	AppliedAt string `json:"appliedAt,omitempty"` // of the last successful sync
	Syncs     uint64 `json:"syncs"`
	Failed    uint64 `json:"failed"`
	Watching  struct {
		Pods        int `json:"pods"`
		LocalPods   int `json:"localPods"`
		HostNetwork int `json:"hostNetwork"`
		NoAddress   int `json:"noAddress"`
		Terminated  int `json:"terminated"`
		Namespaces  int `json:"namespaces"`
		Policies    int `json:"policies"`
	} `json:"watching"`
	// Policies are those in force here: each selects a pod of this node.
	Policies []PolicyInForce `json:"policies"`
	// Idle counts the policies that select no pod of this node.
	Idle int `json:"idle"`
	// BlockedLog is the log of blocked connections.
	BlockedLog BlockedLogReport `json:"blockedLog"`
}

// BlockedLogReport says whether the router logs the connections the
// policies block (sampled through nflog) and how much it logged.
type BlockedLogReport struct {
	On    bool   `json:"on"`
	Group int    `json:"group,omitempty"` // the nflog group read
	Error string `json:"error,omitempty"` // why not (any more)
	// Lines logged, LeftOut over the per-minute limit, Lost by the
	// kernel (socket buffer full), since the router started.
	Lines   uint64 `json:"lines"`
	LeftOut uint64 `json:"leftOut"`
	Lost    uint64 `json:"lost"`
}

// PolicyInForce is one NetworkPolicy that selects pods of this node.
type PolicyInForce struct {
	Name    string   `json:"name"` // namespace/name
	Ingress bool     `json:"ingress"`
	Egress  bool     `json:"egress"`
	Pods    []string `json:"pods"` // namespace/name of the selected pods of this node
}

// policyReport is this node's PolicyReport.
func (r *Router) policyReport() PolicyReport {
	if r.policy == nil {
		why := "--network-policy=false"
		if !r.cfg.Kube {
			why = "not in --kube mode"
		}
		return PolicyReport{Off: why, Policies: []PolicyInForce{}}
	}
	return r.policy.report()
}

func (w *policyWatch) report() PolicyReport {
	rep := PolicyReport{Enabled: true, Node: w.node, Policies: []PolicyInForce{}, BlockedLog: w.blockedLogReport()}
	select {
	case <-w.synced:
		rep.Synced = true
	default:
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	rep.Syncs, rep.Failed = w.total[0]+w.total[1], w.total[1]
	var errs []string
	for _, res := range slices.Sorted(maps.Keys(w.listErrs)) {
		errs = append(errs, w.listErrs[res].Error())
	}
	if w.lastErr != nil {
		errs = append(errs, fmt.Sprintf("the last %d syncs failed: %v", w.failures, w.lastErr))
	}
	rep.Error = strings.Join(errs, "; ")
	if !w.appliedAt.IsZero() {
		rep.AppliedAt = w.appliedAt.UTC().Format(time.RFC3339)
	}
	st := w.compiled
	if st == nil {
		return rep
	}
	rep.Applied = w.lastErr == nil
	c := st.counts
	rep.Watching.Pods, rep.Watching.LocalPods, rep.Watching.HostNetwork = c.Pods, c.LocalPods, c.HostNetwork
	rep.Watching.NoAddress, rep.Watching.Terminated, rep.Watching.Namespaces, rep.Watching.Policies = c.NoAddress, c.Terminated, c.Namespaces, c.Policies
	for i := range st.policies {
		p := &st.policies[i]
		sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		pf := PolicyInForce{Name: p.Namespace + "/" + p.Name}
		pf.Ingress, pf.Egress = policy.Types(p)
		for _, x := range st.pods {
			if err == nil && x.Namespace == p.Namespace && sel.Matches(labels.Set(x.Labels)) {
				pf.Pods = append(pf.Pods, x.Namespace+"/"+x.Name)
			}
		}
		if len(pf.Pods) == 0 {
			rep.Idle++
			continue
		}
		rep.Policies = append(rep.Policies, pf)
	}
	return rep
}

// policySummary is the Status line of the networkpolicy service in
// weft status; weft status policy has the detail.
func policySummary(rep PolicyReport) string {
	switch {
	case !rep.Enabled:
		return "off (" + rep.Off + ")"
	case !rep.Synced:
		return "starting: the pod, namespace and NetworkPolicy lists are not read yet"
	case rep.Syncs == 0:
		return "starting"
	case !rep.Applied:
		return "NOT ENFORCED: the rules failed to apply (weft status policy)"
	case len(rep.Policies) == 1:
		return "enforced (1 policy selects pods of this node)"
	}
	return fmt.Sprintf("enforced (%d policies select pods of this node)", len(rep.Policies))
}

// WritePolicy writes the text of GET /status/policy.
func WritePolicy(w io.Writer, rep PolicyReport) {
	if !rep.Enabled {
		fmt.Fprintf(w, "NetworkPolicy: not enforced by weft (%s)\n", rep.Off)
		return
	}
	switch {
	case !rep.Synced:
		fmt.Fprintf(w, "NetworkPolicy: starting on node %s: the pod, namespace and NetworkPolicy lists are not read yet\n", rep.Node)
	case rep.Applied:
		fmt.Fprintf(w, "NetworkPolicy: enforced on node %s (rules applied at %s; %d syncs, %d failed)\n", rep.Node, rep.AppliedAt, rep.Syncs, rep.Failed)
	case rep.AppliedAt == "":
		fmt.Fprintf(w, "NetworkPolicy: NOT ENFORCED on node %s: the rules below were never applied (%d syncs, %d failed)\n", rep.Node, rep.Syncs, rep.Failed)
	default:
		fmt.Fprintf(w, "NetworkPolicy: NOT UP TO DATE on node %s: the rules below failed to apply; older ones, applied at %s, are in force (%d syncs, %d failed)\n",
			rep.Node, rep.AppliedAt, rep.Syncs, rep.Failed)
	}
	if rep.Error != "" {
		fmt.Fprintf(w, "  Error: %s\n", rep.Error)
	}
	if !rep.Synced || rep.Syncs == 0 {
		return
	}
	v := rep.Watching
	fmt.Fprintf(w, "  Watching: %d pods (%d on this node; left out: %d hostNetwork, %d without an address, %d terminated), %d namespaces, %d policies\n",
		v.Pods, v.LocalPods, v.HostNetwork, v.NoAddress, v.Terminated, v.Namespaces, v.Policies)
	switch b := rep.BlockedLog; {
	case b.On:
		fmt.Fprintf(w, "  Blocked connections: logged (nflog group %d; %d lines, %d left out over %d a minute, %d samples lost)\n", b.Group, b.Lines, b.LeftOut, policyLogMax, b.Lost)
	case b.Error != "":
		fmt.Fprintf(w, "  Blocked connections: NOT LOGGED (%s); weft_policy_blocked_total counts them\n", b.Error)
	default:
		fmt.Fprintln(w, "  Blocked connections: counted in weft_policy_blocked_total, not logged (the enforcer cannot sample)")
	}
	fmt.Fprintln(w)
	if len(rep.Policies) == 0 {
		fmt.Fprintln(w, "No policy selects a pod of this node: its pods are not isolated.")
	} else {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "POLICY\tTYPES\tPODS ON THIS NODE")
		for _, p := range rep.Policies {
			var types []string
			if p.Ingress {
				types = append(types, "ingress")
			}
			if p.Egress {
				types = append(types, "egress")
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", p.Name, strings.Join(types, ","), strings.Join(p.Pods, ", "))
		}
		tw.Flush()
	}
	switch rep.Idle {
	case 0:
	case 1:
		fmt.Fprintln(w, "1 more policy selects no pod of this node.")
	default:
		fmt.Fprintf(w, "%d more policies select no pod of this node.\n", rep.Idle)
	}
}
