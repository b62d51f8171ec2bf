package nscluster

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Matrix says which of a set of endpoints reached which.
type Matrix struct {
	Names []string
	// OK[i][j] says whether Names[i] reached Names[j]; the diagonal is true.
	OK [][]bool
	// Problems that make the matrix wrong whatever OK says, e.g. two
	// endpoints with the same address.
	Problems []string
}

// NewMatrix returns a matrix for names with only the diagonal set.
func NewMatrix(names []string) *Matrix {
	m := &Matrix{Names: names, OK: make([][]bool, len(names))}
	for i := range m.OK {
		m.OK[i] = make([]bool, len(names))
		m.OK[i][i] = true
	}
	return m
}

// AllOK reports whether every endpoint reached every other, with no problems.
func (m *Matrix) AllOK() bool { return len(m.Failures()) == 0 }

// Failures lists the problems, then the pairs that failed as "from -> to".
func (m *Matrix) Failures() []string {
	f := append([]string(nil), m.Problems...)
	for i, row := range m.OK {
		for j, ok := range row {
			if !ok {
				f = append(f, m.Names[i]+" -> "+m.Names[j])
			}
		}
	}
	return f
}

// String draws the matrix: a row per source, a column per destination,
// ✓ for reached, ✗ for not, · on the diagonal.
func (m *Matrix) String() string {
	w := 0
	for _, n := range m.Names {
		w = max(w, utf8.RuneCountInString(n))
	}
	pad := func(s string, width int) string {
		return s + strings.Repeat(" ", max(0, width-utf8.RuneCountInString(s)))
	}
	var b strings.Builder
	b.WriteString(pad("", w))
	for _, n := range m.Names {
		b.WriteString("  " + pad(n, w))
	}
	b.WriteByte('\n')
	for i, row := range m.OK {
		b.WriteString(pad(m.Names[i], w))
		for j, ok := range row {
			mark := "✗"
			switch {
			case i == j:
				mark = "·"
			case ok:
				mark = "✓"
			}
			b.WriteString("  " + pad(mark, w))
		}
		b.WriteByte('\n')
	}
	fmt.Fprintf(&b, "%d of %d pairs reached\n", m.reached(), len(m.Names)*(len(m.Names)-1))
	for _, p := range m.Problems {
		b.WriteString("problem: " + p + "\n")
	}
	return b.String()
}

func (m *Matrix) reached() int {
	n := 0
	for i, row := range m.OK {
		for j, ok := range row {
			if ok && i != j {
				n++
			}
		}
	}
	return n
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	s = strings.TrimRight(s, "\n")
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
