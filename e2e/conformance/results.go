package conformance

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Spec is one spec (ginkgo It) of the suite's JSON report, as far as the
// counts need it.
type Spec struct {
	Name    string
	State   string // passed, skipped, failed, panicked, timedout, interrupted, aborted, pending
	Message string // the failure or the reason of a skip
	RunTime time.Duration
	Ran     bool // attempted: a spec the focus left out never is
}

// Results are the counts of one run of the suite.
type Results struct {
	Passed, Failed []Spec
	// Skipped are specs the focus chose that skipped themselves at run time
	// (a provider, a feature or a node count the cluster does not have).
	Skipped []Spec
	// NotSelected is how many specs the focus and skip left out.
	NotSelected int
	// NotReached is how many selected specs never ran: the suite was
	// interrupted (its timeout) before them.
	NotReached int
}

// ginkgoReport is the part of ginkgo's JSON report (--ginkgo.json-report,
// a list of types.Report) that Summarize reads.
type ginkgoReport struct {
	SuiteDescription string
	PreRunStats      struct {
		TotalSpecs       int
		SpecsThatWillRun int
	}
	SpecReports []struct {
		ContainerHierarchyTexts []string
		LeafNodeType            string
		LeafNodeText            string
		State                   string
		NumAttempts             int
		RunTime                 time.Duration
		Failure                 struct {
			Message string
		}
	}
}

// Summarize reads ginkgo's JSON report into Results. Only It specs count
// (suite set-up and report nodes do not).
func Summarize(data []byte) (Results, error) {
	var reports []ginkgoReport
	if err := json.Unmarshal(data, &reports); err != nil {
		return Results{}, fmt.Errorf("conformance: reading the suite's JSON report: %w", err)
	}
	if len(reports) == 0 {
		return Results{}, fmt.Errorf("conformance: the suite's JSON report holds no suite")
	}
	var r Results
	willRun := 0
	for _, rep := range reports {
		willRun += rep.PreRunStats.SpecsThatWillRun
		for _, s := range rep.SpecReports {
			if s.LeafNodeType != "It" {
				continue
			}
			spec := Spec{
				Name:    strings.TrimSpace(strings.Join(append(append([]string{}, s.ContainerHierarchyTexts...), s.LeafNodeText), " ")),
				State:   s.State,
				Message: s.Failure.Message,
				RunTime: s.RunTime,
				Ran:     s.NumAttempts > 0,
			}
			switch s.State {
			case "passed":
				r.Passed = append(r.Passed, spec)
			case "skipped", "pending":
				if spec.Ran {
					r.Skipped = append(r.Skipped, spec)
				} else {
					r.NotSelected++
				}
			default:
				r.Failed = append(r.Failed, spec)
			}
		}
	}
	// Specs the suite never reached look like those the focus left out.
	if ran := len(r.Passed) + len(r.Failed) + len(r.Skipped); willRun > ran {
		r.NotReached = willRun - ran
		r.NotSelected -= r.NotReached
	}
	for _, l := range [][]Spec{r.Passed, r.Failed, r.Skipped} {
		sort.Slice(l, func(i, j int) bool { return l[i].Name < l[j].Name })
	}
	return r, nil
}

// Table is the results as an operator reads them: the counts, then every
// failed and skipped spec with its reason, then the passed ones.
func (r Results) Table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d passed, %d failed, %d skipped at run time, %d selected but not reached (%d specs not selected by the focus)\n",
		len(r.Passed), len(r.Failed), len(r.Skipped), r.NotReached, r.NotSelected)
	line := func(tag string, s Spec, why bool) {
		fmt.Fprintf(&b, "  %-7s %6s  %s\n", tag, s.RunTime.Round(time.Second), s.Name)
		if why && s.Message != "" {
			msg := strings.Join(strings.Fields(s.Message), " ")
			if len(msg) > 300 {
				msg = msg[:300] + "…"
			}
			fmt.Fprintf(&b, "          %s\n", msg)
		}
	}
	for _, s := range r.Failed {
		line("FAIL", s, true)
	}
	for _, s := range r.Skipped {
		line("SKIP", s, true)
	}
	for _, s := range r.Passed {
		line("ok", s, false)
	}
	return b.String()
}
